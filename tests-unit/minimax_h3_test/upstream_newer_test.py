"""Issue 19, phase 1: the reference outputs of a newer upstream H3, what they must show, and the harness.

The committed data is checked against the pinned base (cases whose features did not change must equal
upstream at 0f1fa67) and against hand-derived facts of the newer features; the last test re-runs the newer
upstream file itself when one is present and skips with the reason otherwise.
"""

import math

import pytest
import torch

import upstream_newer as un

pytestmark = pytest.mark.comfyui

MASK_CASES = [n for n, (_, opts, _) in un.CASES.items() if opts.get("video_mask") or opts.get("audio_mask")]
UNCHANGED = [n for n, (_, _, unchanged) in un.CASES.items() if unchanged]


def _dtype(name):
    return getattr(torch, un.CASES[name][0].get("dtype", "float32"))


def _base_upstream():
    import comfy.ldm.minimax.model as upstream
    if not hasattr(upstream, "PackedLayout") or upstream.MiniMaxH3Model.__module__ != "comfy.ldm.minimax.model":
        pytest.skip("comfy.ldm.minimax.model re-exports this package (patched tree): there is no upstream model to compare")
    return upstream


def test_reference_names_its_source_and_covers_every_case(comfyui_dir, reference):
    tensors, manifest = reference
    assert manifest["format"] == un.FORMAT and manifest["reference"] == un.REFERENCE and manifest["base"] == un.BASE_COMMIT
    assert set(manifest["cases"]) == set(un.CASES)
    for name in un.CASES:
        x, *_ = un.case_inputs(name, _dtype(name))
        assert tensors[f"{name}.video"].shape == x[0].shape and tensors[f"{name}.audio"].shape == x[1].shape
        assert tensors[f"{name}.video"].dtype == _dtype(name)


def test_recipe_regenerates_the_recorded_weights_and_inputs(comfyui_dir, reference):
    _, manifest = reference
    for key, model in manifest["models"].items():
        weights = un.weights_from_spec(model["spec"], manifest["seed"])
        assert un.weights_digest(weights) == model["weights_digest"], f"weights of model {key} drifted"
    for name, case in manifest["cases"].items():
        assert un.input_digest(*un.case_inputs(name, _dtype(name), manifest["seed"])) == case["input_digest"], f"{name} inputs drifted"


def test_loader_runs_the_pinned_base_file_unchanged_and_patches_nothing(comfyui_dir):
    import comfy.ldm.modules.attention as attention
    import comfy.model_prefetch
    upstream = _base_upstream()
    loaded = un.load_upstream(upstream.__file__)
    assert loaded is not upstream and loaded.MiniMaxH3Model is not upstream.MiniMaxH3Model
    # the shims live in the loaded module's import function only
    assert not hasattr(attention, "ComfyAttention") and not hasattr(comfy.model_prefetch, "malloc_graph_enabled")
    for name in ("keyframes_tags", "refs_all"):
        model, _ = un.build_model(loaded, {})
        theirs, _ = un.build_model(upstream, {})
        for got, want in zip(un.run_case(loaded, name, model=model)[:2], un.run_case(upstream, name, model=theirs)[:2]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("name", UNCHANGED)
def test_unchanged_features_equal_upstream_at_the_pinned_base(comfyui_dir, reference, name):
    tensors, _ = reference
    upstream = _base_upstream()
    # the pinned base has no VSA gate: build it without, the seeded weights of every other key are the same
    model_opts = {k: v for k, v in un.CASES[name][0].items() if k != "gate_compress"}
    model, _ = un.build_model(upstream, model_opts)
    video, audio, _ = un.run_case(upstream, name, model=model)
    un.assert_case_outputs(video, audio, tensors, name)


@pytest.mark.parametrize("name", MASK_CASES)
def test_masked_rows_scale_their_velocity_by_the_mask(comfyui_dir, reference, name):
    """PR #15988: a row evaluated at mask * sigma returns mask * velocity, so the sampler's x0 = x - sigma * v
    keeps a preserved (mask 0) latent exactly; everything the mask lets through moves."""
    tensors, _ = reference
    x, _, _, _, masks, _ = un.case_inputs(name, _dtype(name))
    for stream, key in ((0, "denoise_mask"), (1, "audio_denoise_mask")):
        if key not in masks:
            continue
        out = tensors[f"{name}.{('video', 'audio')[stream]}"]
        m = masks[key].expand_as(out)
        if stream == 1 and un.CASES[name][1].get("audio_scale", 1.0) != 1.0:
            continue  # the carry conversion adds a mask-independent term, checked below
        assert torch.equal(out[m == 0], torch.zeros_like(out[m == 0])), name
        assert bool((out[m != 0] != 0).all()), name


def test_audio_mask_applies_before_the_audio_carry(comfyui_dir, reference):
    """Masked audio frames keep only the carry term of d/d(sigma_v): (1 - s) * x_a * sigma_a / sigma_v."""
    tensors, manifest = reference
    name = "masks_keyframes_scale"
    x, timestep, _, payload, masks, _ = un.case_inputs(name)
    scale = payload["audio_scale"]
    shift_v, shift_a = manifest["shifts"]
    sigma_v = float(timestep[0]) / 1000.0
    base = sigma_v / (shift_v + sigma_v * (1.0 - shift_v))
    sigma_a = shift_a * base / (1.0 + (shift_a - 1.0) * base)
    held = masks["audio_denoise_mask"].expand_as(x[1]) == 0
    expected = (1.0 - scale) * x[1].double() * (sigma_a / sigma_v)
    got = tensors[f"{name}.audio"]
    assert math.isclose(scale, 0.7) and held.any()
    torch.testing.assert_close(got[held].double(), expected[held], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[~held].double(), expected[~held], atol=1e-3)


def _pdd_head(bank, bias, heads, start, stop, shift):
    """The head a PDD step uses, by hand: row block 0 is a full head, blocks 1.. are offsets from it,
    weighted by the step's share dt of the shifted time grid (PR #15908)."""
    grid = [1.0 - k / heads for k in range(heads + 1)]
    t = [1.0 - shift * g / (1.0 + (shift - 1.0) * g) for g in grid]
    dt = [t[k + 1] - t[k] for k in range(start, stop)]
    w = [d / sum(dt) for d in dt]
    rows, brows = bank.double().reshape(heads, -1, bank.shape[1]), bias.double().reshape(heads, -1)
    weight, b = rows[0].clone(), brows[0].clone()
    for k in range(max(start, 1), stop):
        weight += w[k - start] * rows[k]
        b += w[k - start] * brows[k]
    return weight.float(), b.float()


@pytest.mark.parametrize("name", ["pdd_first", "pdd_mid", "pdd_last"])
def test_pdd_step_uses_the_dt_weighted_heads_it_spans(comfyui_dir, reference, name):
    """A bank model's step equals the plain model at the pinned base whose heads are mixed by hand."""
    tensors, manifest = reference
    upstream = _base_upstream()
    model_opts, opts, _ = un.CASES[name]
    heads = model_opts["pdd_heads"]
    sigma = float(un.sample_sigmas()[opts["step"]])
    sigma_next = float(un.sample_sigmas()[opts["step"] + 1])
    shift_v, shift_a = manifest["shifts"]

    def grid_index(s):  # the base (unshifted) time grid position of a video sigma, in heads
        return round((1.0 - s / (shift_v + s * (1.0 - shift_v))) * heads)
    start, stop = min(grid_index(sigma), heads - 1), grid_index(sigma_next)
    stop = max(stop, start + 1)
    assert stop - start == heads // 8
    bank = un.weights_from_spec(manifest["models"][un.model_key(model_opts)]["spec"], manifest["seed"])
    model, _ = un.build_model(upstream, {})
    sd = model.state_dict()
    for stream, shift in (("video", shift_v), ("audio", shift_a)):
        key = f"final_layer.{stream}_out"
        sd[key + ".weight"], sd[key + ".bias"] = _pdd_head(bank[key + ".weight"], bank[key + ".bias"], heads, start, stop, shift)
    model.load_state_dict(sd)
    video, audio, _ = un.run_case(upstream, name, model=model)
    un.assert_case_outputs(video, audio, tensors, name)


def test_vsa_gate_weights_load_and_leave_the_dense_forward_unchanged(comfyui_dir, reference):
    tensors, manifest = reference
    spec = {k: shape for k, shape, _ in manifest["models"][un.model_key({"gate_compress": True})]["spec"]}
    inner = un.TINY["num_attention_heads"] * un.TINY["attention_head_dim"]
    gates = sorted(k for k in spec if k.endswith("attn.to_gate_compress.weight"))
    assert gates == [f"blocks.{i}.attn.to_gate_compress.weight" for i in range(un.TINY["num_layers"])]
    assert all(spec[k] == [inner, un.TINY["hidden_size"]] for k in gates)
    for stream in ("video", "audio"):
        assert torch.equal(tensors[f"vsa_gate.{stream}"], tensors[f"t2va.{stream}"])


def test_block_patches_see_layout_block_index_and_an_attention_override(comfyui_dir, reference):
    tensors, manifest = reference
    upstream = _base_upstream()
    calls = manifest["cases"]["block_hook"]["hook_calls"]
    x, _, context, payload, _, _ = un.case_inputs("block_hook")
    layout = upstream.PackedLayout(context.shape[1], x[0].shape[2], x[0].shape[3], x[0].shape[4], x[1].shape[-1],
                                   keyframes=payload["keyframes"])
    assert [c["block_index"] for c in calls] == list(range(un.TINY["num_layers"]))
    for c in calls:
        assert "layout" in c["arg_keys"] and c["options_layout_is_args_layout"]
        assert c["layout_segments"] == [list(s) for s in layout.segments]
    # the override halves every block's attention: the output moves away from the plain forward of the same inputs
    model, _ = un.build_model(upstream, {})
    x, timestep, context, payload, masks, options = un.case_inputs("block_hook")
    plain = model(x, timestep, context, options, minimax_payload=payload, **masks)[0]
    assert not torch.allclose(tensors["block_hook.video"], plain, atol=1e-3)


def test_newer_upstream_reproduces_the_reference(comfyui_dir, reference):
    tensors, manifest = reference
    module = un.upstream_or_skip()
    assert module.H3_SHIMS == manifest["shims"]
    for name in un.CASES:
        video, audio, seen = un.run_case(module, name, manifest["seed"])
        un.assert_case_outputs(video, audio, tensors, name)
        assert seen == {k: v for k, v in manifest["cases"][name].items() if k == "hook_calls"}
