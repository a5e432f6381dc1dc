"""Sharded H3 steps on gloo ranks, for parity tests against the newer-upstream reference.

Every rank runs the model's own ``forward``; the SequenceParallelRunner it finds in its options
(``RankRunner``) sends the StepInputs through their wire form (encode, a JSON round trip, decode),
as the sequence-parallel workers receive them, rebuilds the plan on ranks > 0, checks that every
rank's plan digest is the same, and runs this rank's shard with ``ulysses.sharded_forward``.
"""

import json
import math

import torch
import torch.distributed as dist

import mask_edges as me
import upstream_newer as un
from comfy.ldm.minimax_h3.model import SEQUENCE_PARALLEL_OPTION
from comfy.ldm.minimax_h3.step_io import StepInputs
from comfy.ldm.minimax_h3.ulysses import sharded_forward


class RankRunner:
    """The runner each rank's model calls; ``extra_options`` are added to the decoded options on every
    rank, as the workers add the attention override they select by name."""

    def __init__(self, model, rank, world_size, extra_options=None):
        self.model, self.rank, self.world_size = model, rank, world_size
        self.extra_options = dict(extra_options or {})
        self.digests = []

    def __call__(self, plan, inputs):
        tensors, meta = inputs.encode()
        step = StepInputs.decode({k: v.clone() for k, v in tensors.items()}, json.loads(json.dumps(meta)))
        step.options.update(self.extra_options)
        if self.rank:
            plan = self.model.plan(step)
        mine = torch.frombuffer(bytearray(bytes.fromhex(plan.digest())), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        if any(not torch.equal(d, mine) for d in every):
            raise RuntimeError(f"rank {self.rank}: the ranks built different plans for this step")
        self.digests.append(plan.digest())
        v, a = sharded_forward(self.model, plan, step, self.rank, self.world_size)
        if self.rank:  # only rank 0 gathers the target rows; the others give forward() zeros of their shape
            (va, vb), (aa, ab) = plan.layout.segment("video"), plan.layout.segment("audio")
            v = torch.zeros(vb - va, self.model.latents_dim * math.prod(self.model.patch_size))
            a = torch.zeros(ab - aa, self.model.audio_latents_dim)
        return v, a


def _run(rank, world, names, model_opts, inputs):
    out, digests = {}, {}
    for name in names:
        model, _ = un.build_model(un.ours(), model_opts(name))
        x, timestep, context, payload, kwargs, options = inputs(name, model.dtype)
        runner = RankRunner(model, rank, world)
        options[SEQUENCE_PARALLEL_OPTION] = runner
        video, audio = model(x, timestep, context, options, minimax_payload=payload, **kwargs)
        digests[name] = runner.digests[-1]
        if rank == 0:
            out[f"{name}.video"], out[f"{name}.audio"] = video, audio
    return dict(out, digests=digests)


def run_cases(rank, world, names):
    """Each upstream_newer case (seeded model and inputs) through this rank's sharded forward ->
    {"<case>.video" / "<case>.audio": rank 0's outputs, "digests": {case: plan digest}}."""
    return _run(rank, world, names, lambda name: un.CASES[name][0], un.case_inputs)


def run_edges(rank, world):
    """``run_cases`` for every mask_edges edge (its reference case's model, uniform masks)."""
    return _run(rank, world, list(me.EDGES), lambda name: un.CASES[me.EDGES[name][0]][0], me.edge_inputs)
