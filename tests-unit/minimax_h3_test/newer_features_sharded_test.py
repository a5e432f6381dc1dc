"""The newer-upstream features (denoise masks, PDD heads, block-patch layout, sparse-attention hooks,
VSA gates, fp16 residual) sharded: on 2 and 3 gloo ranks through each rank's own forward (``rank_steps``,
the StepInputs through their wire form), and on sequence-parallel groups of headless ComfyUI workers
loading a real checkpoint. The native halves, and what the cases are, live in each feature's test file.

Tolerance: the stored reference's (``upstream_newer.assert_matches``); sharded against native fp32
max |diff| <= 1e-5 * max |native|, fp16 2e-3.
"""

import pytest
import torch

import mask_edges as me
import rank_steps
import upstream_newer as un
from comfy.ldm.minimax_h3.model import SEQUENCE_PARALLEL_OPTION
from h3_files import TINY_CONFIG, write_h3_file

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("linux_workers")]


# -- denoise masks --------------------------------------------------------------------------------------

def _cases_and_edges_on_ranks(rank, world):
    cases = rank_steps.run_cases(rank, world, me.MASK_CASES)
    edge = rank_steps.run_edges(rank, world)
    return {**cases, **edge, "digests": {**cases["digests"], **edge["digests"]}}


@pytest.mark.parametrize("world", [2, 3])
def test_denoise_masks_match_newer_upstream(comfyui_dir, reference, edges, run_ranks, world):
    tensors, _ = reference
    results = run_ranks(_cases_and_edges_on_ranks, world, timeout=600)
    for name in me.MASK_CASES:
        un.assert_case_outputs(results[0][f"{name}.video"], results[0][f"{name}.audio"], tensors, name)
    for name in me.EDGES:
        me.check_edge(name, results[0][f"{name}.video"], results[0][f"{name}.audio"], tensors, edges[0])
    for name in me.MASK_CASES + list(me.EDGES):
        assert len({r["digests"][name] for r in results}) == 1, name


@pytest.fixture
def sp_reference_group(comfyui_patched, tmp_path):
    import comfy.sd
    from safetensors.torch import save_file

    from comfy.ldm.minimax_h3.sequence_parallel import SequenceParallel
    from comfy.parallel import Timeouts, headless
    model, weights = un.build_model(un.ours(), {})
    path = str(tmp_path / "h3_reference_weights.safetensors")
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in weights.items()}, path)
    base = comfy.sd.load_diffusion_model(path)
    sp = SequenceParallel(["cpu"] * 3, headless.loader_call(base), headless.execution_settings(),
                          timeouts=Timeouts(startup=300, op=120, cancel=20))
    try:
        sp.prepare(base)
        yield sp, base.model.diffusion_model
    finally:
        sp.close()


def test_denoise_masks_on_workers_match_newer_upstream(sp_reference_group, reference, edges):
    sp, rank0 = sp_reference_group
    tensors, _ = reference
    names = [n for n in me.MASK_CASES if not un.CASES[n][0]]  # the checkpoint is the plain fp32 model
    for name in names:
        x, timestep, context, payload, masks, options = un.case_inputs(name)
        video, audio = rank0(x, timestep, context, dict(options, **{SEQUENCE_PARALLEL_OPTION: sp}), minimax_payload=payload, **masks)
        un.assert_case_outputs(video, audio, tensors, name)
    for name in ("video_zeros", "both_zeros_scale", "video_threshold", "video_near_one"):
        x, timestep, context, payload, masks, options = me.edge_inputs(name)
        video, audio = rank0(x, timestep, context, dict(options, **{SEQUENCE_PARALLEL_OPTION: sp}), minimax_payload=payload, **masks)
        me.check_edge(name, video, audio, tensors, edges[0])
    assert sp.steps_run == len(names) + 4


# -- PDD heads ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
def test_pdd_heads_match_newer_upstream(comfyui_dir, reference, run_ranks, world):
    # the workers get sample_sigmas only through the step inputs; the runner checks every rank's plan digest
    tensors, _ = reference
    names = ["pdd_first", "pdd_mid", "pdd_mask"]
    results = run_ranks(rank_steps.run_cases, world, kwargs={"names": names}, timeout=300)
    un.assert_ranks_match(results, tensors, names)


# -- block patches, sparse-attention hooks, VSA gates ----------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
def test_block_hook_cases_match_newer_upstream(comfyui_dir, reference, run_ranks, world):
    tensors, _ = reference
    names = ["t2va", "vsa_gate"]
    results = run_ranks(rank_steps.run_cases, world, kwargs={"names": names}, timeout=300)
    un.assert_ranks_match(results, tensors, names)


SEEN = []


def segment_attention(func, q, k, v, heads, mask=None, skip_reshape=False, transformer_options={}, **kwargs):
    """A kernel-level sparse attention (optimized_attention_override): rows attend only within their
    own layout segment. It needs every row of its heads, which Ulysses' all-to-all gives each rank."""
    layout = transformer_options["minimax_h3_layout"]
    seq = q.shape[2]  # [1, heads, S, D]
    if seq != layout.seq_len:  # the token refiner's text-only attention stays dense
        return func(q, k, v, heads, mask=mask, skip_reshape=skip_reshape, transformer_options=transformer_options, **kwargs)
    SEEN.append(transformer_options["block_index"])
    seg = torch.empty(seq, dtype=torch.long)
    for i, (a, b, _) in enumerate(layout.segments):
        seg[a:b] = i
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seg[:, None] == seg[None, :])
    return out.transpose(1, 2).reshape(q.shape[0], seq, -1)


def _segment_attention_case(rank, world):
    SEEN.clear()
    model, _ = un.build_model(un.ours(), {})
    x, timestep, context, payload, _, options = un.case_inputs("keyframes_tags")
    extra = {"optimized_attention_override": segment_attention}
    if world > 1:
        options[SEQUENCE_PARALLEL_OPTION] = rank_steps.RankRunner(model, rank, world, extra_options=extra)
    else:
        options.update(extra)
    video, audio = model(x, timestep, context, options, minimax_payload=payload)
    return {"video": video, "audio": audio, "seen": list(SEEN)}


@pytest.mark.parametrize("world", [2, 3])
def test_kernel_sparse_attention_reads_the_global_layout_on_every_rank(comfyui_dir, run_ranks, world):
    native = _segment_attention_case(0, 1)
    blocks = list(range(TINY_CONFIG["num_layers"]))
    assert native["seen"] == blocks
    model, _ = un.build_model(un.ours(), {})
    x, timestep, context, payload, _, _ = un.case_inputs("keyframes_tags")
    dense = model(x, timestep, context, {}, minimax_payload=payload)
    assert not torch.allclose(native["video"], dense[0], atol=1e-3)  # the sparsity changes the result
    results = run_ranks(_segment_attention_case, world, timeout=300)
    for r in results:  # every rank's own options carried the layout and block_index (one call per head chunk)
        assert sorted(set(r["seen"])) == blocks and r["seen"] == sorted(r["seen"]), r["seen"]
    for stream in ("video", "audio"):
        got, want = results[0][stream], native[stream]
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), stream


def test_vsa_checkpoint_runs_sharded_on_workers_that_loaded_it(comfyui_patched, tmp_path):
    # every worker loads the file with rank 0's loader call: the forward's preflight compares plan digests,
    # which name the gated model (a worker that dropped the gates would refuse the step)
    import comfy.sd
    from comfy.ldm.minimax_h3.sequence_parallel import SequenceParallel
    from comfy.parallel import Timeouts, headless
    path = write_h3_file(str(tmp_path / "h3_vsa.safetensors"), dict(TINY_CONFIG, gate_compress=True), seed=6)
    base = comfy.sd.load_diffusion_model(path)
    model = base.model.diffusion_model
    sp = SequenceParallel(["cpu"] * 2, headless.loader_call(base), headless.execution_settings(),
                          timeouts=Timeouts(startup=120, op=60, cancel=10))
    try:
        sp.ensure_started(base)
        sp.prepare(base)
        x, timestep, context, payload, _, _ = un.case_inputs("keyframes_tags")
        sharded = model(x, timestep, context, {SEQUENCE_PARALLEL_OPTION: sp}, minimax_payload=dict(payload))
        native = model(x, timestep, context, {}, minimax_payload=dict(payload))
    finally:
        sp.close()
    assert model.config["gate_compress"] and sp.steps_run == 1
    for s, n in zip(sharded, native):
        assert (s - n).abs().max() <= 1e-5 * n.abs().max()


# -- fp16 compute: the residual stays fp32 on every rank ---------------------------------------------------

def _loud_on_ranks(rank, world):
    model = un.loud_model(un.ours(), torch.float16)
    x, timestep, context, payload, _, _ = un.case_inputs("t2va")
    half_x, half_context = un.half(x, context)
    native = model(half_x, timestep, half_context, {}, minimax_payload=dict(payload))
    options = {SEQUENCE_PARALLEL_OPTION: rank_steps.RankRunner(model, rank, world)}
    sharded = model(half_x, timestep, half_context, options, minimax_payload=dict(payload))
    return {"native_video": native[0], "native_audio": native[1], "video": sharded[0], "audio": sharded[1]} if rank == 0 else {}


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_sharded_matches_native(comfyui_dir, run_ranks, world):
    # fp16 q|k|v cross the all-to-all; every rank's residual rows stay fp32
    out = run_ranks(_loud_on_ranks, world, timeout=300)[0]
    for stream in ("video", "audio"):
        got, want = out[stream].float(), out[f"native_{stream}"].float()
        assert bool(torch.isfinite(got).all()) and float((got - want).abs().max() / want.abs().max()) <= 2e-3, stream
