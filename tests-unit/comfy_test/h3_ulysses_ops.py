"""The op of test_minimax_h3_ulysses.py, which every rank of its comfy.parallel group runs (a plain module:
the workers import it by name)."""

import minimax_h3_cases as cases
from comfy.ldm.minimax.ulysses import UlyssesParallel
from comfy.parallel import register_op

OP = "minimax_h3_test.cases"


class Counted:
    """The group's transport, counting the bytes this rank sends to other ranks."""

    def __init__(self, transport):
        self.transport, self.sent = transport, 0

    def all_to_all(self, sends, recvs, sizes):
        self.sent += sum(s for j, s in enumerate(sizes[self.transport.rank]) if j != self.transport.rank)
        return self.transport.all_to_all(sends, recvs, sizes)


@register_op(OP)
def sharded_cases(ctx, meta):
    """Every rank runs each case sharded; rank 0 also runs it natively -> {case: max rel diff}."""
    report = {}
    for name, (model_opts, opts) in cases.CASES.items():
        if opts.get("block_patch") or opts.get("controlnet"):  # block patches index global rows: native only
            continue
        model = cases.build_model(model_opts, **meta["config"])
        sp = UlyssesParallel(ctx.rank, ctx.world_size, model.blocks[0].attn.heads, Counted(ctx.transport),
                             chunks=meta["chunks"], fp8=meta["fp8"], gather=meta.get("gather"))
        sharded = cases.run_case(name, model=model, transformer_options={"minimax_h3_sequence_parallel": sp})
        if ctx.rank == 0:
            native = cases.run_case(name, model=model)
            if name == "t2va":
                report["bytes sent by rank 0"] = sp.transport.sent
            report[name] = max(float((s.float() - n.float()).abs().max() / n.float().abs().max()) for s, n in zip(sharded, native))
    return report
