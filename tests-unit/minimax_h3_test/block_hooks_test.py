"""Issue 19 items 3 and 4: block patches get the layout, sparse-attention hooks, VSA gate weights.

Checked against the newer upstream's stored outputs (block_hook, vsa_gate, t2va), against the pinned
base's upstream model for a Fun ControlNet-Union style patch (``layout.img_pos``, ``DiTBlock.forward``),
and through ComfyUI's loader for a VSA checkpoint. Sharded (gloo ranks, worker groups, a kernel-level
sparse attention on every rank): newer_features_sharded_test.
"""

import logging

import pytest
import torch

import upstream_newer as un
from comfy.ldm.minimax_h3.model import SEQUENCE_PARALLEL_OPTION, MiniMaxH3Model
from h3_files import TINY_CONFIG, write_h3_file
from upstream_newer_test import _base_upstream

pytestmark = pytest.mark.comfyui


@pytest.mark.parametrize("name", ["t2va", "block_hook", "vsa_gate"])
def test_native_matches_newer_upstream(comfyui_dir, reference, name):
    tensors, manifest = reference
    model, _ = un.build_model(un.ours(), un.CASES[name][0])
    video, audio, seen = un.run_case(un.ours(), name, model=model)
    un.assert_case_outputs(video, audio, tensors, name)
    # the hook saw block_index 0..L-1, args["layout"] (the same object as transformer_options'), the segments
    assert seen == {k: v for k, v in manifest["cases"][name].items() if k == "hook_calls"}


def test_block_patches_and_attention_overrides_are_refused_sharded(comfyui_dir):
    model, _ = un.build_model(un.ours(), {})
    x, timestep, context, payload, _, options = un.case_inputs("block_hook")
    options.update(un._attention_hook(model, []))

    def sending(plan, inputs):  # a runner sends the step's inputs to the other ranks: encode() refuses them
        inputs.encode()
        pytest.fail("the step inputs were encoded for the other ranks")
    options[SEQUENCE_PARALLEL_OPTION] = sending
    # refused on rank 0 before anything is sent: a block patch would see rank 0's rows only
    with pytest.raises(ValueError, match=r"cannot run block replacement patches \[.*double_block.*\].*run on one GPU"):
        model(x, timestep, context, options, minimax_payload=payload)

    class TwoRanks:
        world_size = 2
    block = model.blocks[0]
    h = torch.zeros(3, TINY_CONFIG["hidden_size"])
    with pytest.raises(ValueError, match=r"attention= override: it would attend over this rank's rows only"):
        block(h, torch.zeros(2, TINY_CONFIG["time_embed_dim"]), [(0, 3, 0)], None, attention=block.attn, seq_parallel=TwoRanks())


def _fun_control_patch(module, control, controls, layout=None):
    """A Fun ControlNet-Union style block patch (its structure, written here): block 0 seeds a control
    stream from the target video rows (``layout.img_pos``), each patched block runs its control block
    through ``DiTBlock.forward`` and adds the control block's projection to the block's output."""
    state = {}

    def patch(args, extra, index):
        lay = args["layout"] if layout is None else layout
        h = args["img"]
        if "c" not in state:
            rows = module.patchify_video(controls)
            c = h.clone()
            c[lay.img_pos] = control["proj_in"](rows).to(h.dtype)
            state["c"] = control["before"](c) + h
        block = control["blocks"][index]
        state["c"] = module.DiTBlock.forward(block, state["c"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                                             transformer_options=args["transformer_options"])
        return {"img": extra["original_block"](args)["img"] + control["after"](state["c"])}
    return {"patches_replace": {"dit": {("double_block", i): lambda args, extra, i=i: patch(args, extra, i)
                                        for i in range(TINY_CONFIG["num_layers"])}}}


def _fun_control(module, seed=3):
    import comfy.ops
    ops = comfy.ops.disable_weight_init
    cfg = TINY_CONFIG
    hidden = cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    blocks = [module.DiTBlock(hidden, cfg["num_attention_heads"], cfg["attention_head_dim"], cfg["ffn_hidden_size"],
                              cfg["time_embed_dim"], 1e-5, 1e-5, apply_silu=True, adaln_dtype=None, dtype=None,
                              device=None, operations=ops) for _ in range(cfg["num_layers"])]
    control = {"blocks": blocks, "proj_in": ops.Linear(96, hidden), "before": ops.Linear(hidden, hidden),
               "after": ops.Linear(hidden, hidden)}
    for m in [*blocks, control["proj_in"], control["before"], control["after"]]:
        m.requires_grad_(False)
        m.load_state_dict({k: torch.randn(v.shape, generator=gen) * (0.05 if k.endswith("bias") else 1.0 / v.shape[-1] ** 0.5)
                           + (1.0 if "norm" in k else 0.0) for k, v in m.state_dict().items()})
    return control


def test_fun_controlnet_union_style_patch_matches_upstream(comfyui_dir):
    from compat_reexport_test import _models, _reexport
    from h3_files import step_inputs
    upstream, reexport = _base_upstream(), _reexport()
    theirs, ours = _models(upstream)
    x, t, c, p = step_inputs(TINY_CONFIG, "t2va")
    controls = torch.randn(1, 24, *x[0].shape[2:], generator=torch.Generator().manual_seed(1))
    # upstream at the pinned base passes no layout to block patches: its patch is handed the layout it builds
    layout = upstream.PackedLayout(c.shape[1], *x[0].shape[2:], x[1].shape[-1])
    want = theirs(x, t, c, _fun_control_patch(upstream, _fun_control(upstream), controls, layout), minimax_payload=dict(p))
    got = ours(x, t, c, _fun_control_patch(reexport, _fun_control(reexport), controls), minimax_payload=dict(p))
    plain = ours(x, t, c, {}, minimax_payload=dict(p))
    for a, b, base in zip(got, want, plain):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
        assert not torch.allclose(a, base, atol=1e-3)  # the control stream reached the output


def test_vsa_checkpoint_loads_its_gates_through_comfyuis_loader(comfyui_patched, tmp_path, caplog):
    import comfy.sd
    cfg = dict(TINY_CONFIG, adaln_curve_grid=None)
    path = write_h3_file(str(tmp_path / "h3_vsa.safetensors"), dict(cfg, gate_compress=True), seed=6)
    with caplog.at_level(logging.WARNING):
        patcher = comfy.sd.load_diffusion_model(path)
    assert not [r for r in caplog.records if "unet unexpected" in r.getMessage() or "unet missing" in r.getMessage()]
    model = patcher.model.diffusion_model
    assert type(model) is MiniMaxH3Model and model.config["gate_compress"] is True
    from safetensors.torch import load_file
    sd = load_file(path)
    for i, block in enumerate(model.blocks):
        gate = block.attn.to_gate_compress.weight
        assert torch.equal(gate, sd[f"model.diffusion_model.blocks.{i}.attn.to_gate_compress.weight"])
        assert gate.shape == (cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["hidden_size"])
    # the dense forward does not use the gate: the same weights without it give the same output
    plain = MiniMaxH3Model(**cfg).requires_grad_(False)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "to_gate_compress" not in k})
    assert plain.model_key != model.model_key  # plans (and their digests) name the gated model
    x, timestep, context, payload, _, _ = un.case_inputs("t2va")
    for a, b in zip(model(x, timestep, context, {}, minimax_payload=dict(payload)),
                    plain(x, timestep, context, {}, minimax_payload=dict(payload))):
        assert torch.equal(a, b)
    assert all(b.attn.to_gate_compress is None for b in plain.blocks)
