"""Overlay: fp8 H3 checkpoints through ComfyUI's own loader, on CPU, against upstream's model.

Two ways ComfyUI runs fp8 weights, both through comfy.sd.load_diffusion_model with the upstream
module re-exporting our model (what the patch series does):
  * weight dtype fp8_e4m3fn (UNETLoader's weight_dtype): every model-dtype tensor (linears, their
    biases, norm weights, adaLN projections) is stored in fp8 and cast to fp32 by manual_cast ops, or by
    our code where it uses a weight directly (fused q/k RMSNorm + rope, fused RMSNorm + adaLN);
  * a scaled-fp8 file (h3_files: the legacy ``scaled_fp8`` marker form and the per-layer
    ``comfy_quant`` form): linears become QuantizedTensor fp8 weights with per-tensor scales under
    comfy.ops.mixed_precision_ops.
The reference is upstream's MiniMaxH3Model (the ComfyUI tree's own code, not ours) in fp32 with
plain ops, holding exactly the values the fp8 model holds: the file's weights rounded to fp8
(times their scale for scaled files). Both then compute in fp32 from identical weights, so they
may differ only by fp32 rounding of ops done in another order: 1e-5 max abs, outputs being O(1).
Measured: 0.0 with fp8 weight dtype; 1.2e-6 with the fused adaLN kernel (norm weight folded into
the scale); 1.0e-6 for scaled files (ComfyUI's quantized linear is ~1e-6 off F.linear on the
dequantized weight). Against upstream with the unrounded weights the same outputs differ by
0.12-0.19, so the tolerance tells fp8 weights from fp32 ones (asserted: > 100 x 1e-5).
"""

import pytest
import torch
from safetensors import safe_open

from comfy.ldm.minimax_h3.layout import PackedLayout
from comfy.ldm.minimax_h3.model import MiniMaxH3Model
from h3_files import TINY_CONFIG, quantized_layers, read_h3_file, step_inputs, write_h3_file

pytestmark = pytest.mark.comfyui

TOL = 1e-5
FP8 = torch.float8_e4m3fn


@pytest.fixture
def loader(comfyui_models, monkeypatch):
    """(load(path, **model_options) -> diffusion model on the load device, upstream's model class)."""
    import comfy.ldm.minimax.model as upstream
    import comfy.model_management
    import comfy.sd
    reference = upstream.MiniMaxH3Model
    if reference is MiniMaxH3Model:
        pytest.skip("comfy.ldm.minimax.model re-exports this package (patched tree): no upstream model to compare with")
    monkeypatch.setattr(upstream, "MiniMaxH3Model", MiniMaxH3Model)
    monkeypatch.setattr(upstream, "PackedLayout", PackedLayout)

    def load(path, **model_options):
        patcher = comfy.sd.load_diffusion_model(str(path), model_options=model_options)
        comfy.model_management.load_models_gpu([patcher])
        patcher.pre_run()
        assert isinstance(patcher.model.diffusion_model, MiniMaxH3Model)
        return patcher.model.diffusion_model

    return load, reference


def _forward(model, cfg):
    x, t, c, p = step_inputs(cfg, "keyframes", height=5)
    with torch.no_grad():
        return model(x, t, c, {}, minimax_payload=p)


def _upstream(reference, cfg, sd):
    import comfy.ops
    model = reference(**cfg, dtype=torch.float32, operations=comfy.ops.disable_weight_init).requires_grad_(False)
    model.load_state_dict(sd)
    return model


def _max_diff(a, b):
    return max(float((u.float() - v.float()).abs().max()) for u, v in zip(a, b))


def _check(model, reference, cfg, held, exact):
    """Max |diff| of model's forward to upstream's on the values the model holds; >100 TOL on the unrounded ones."""
    out = _forward(model, cfg)
    assert all(bool(torch.isfinite(o).all()) for o in out)
    diff = _max_diff(out, _forward(_upstream(reference, cfg, held), cfg))
    assert diff <= TOL, f"fp8 model vs upstream on its dequantized weights: max |diff| {diff}"
    unrounded = _max_diff(out, _forward(_upstream(reference, cfg, exact), cfg))
    assert unrounded > 100 * TOL, f"fp8 rounding changed the output by only {unrounded}: are the weights fp8?"
    return diff, unrounded


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused_adaln"])
@pytest.mark.parametrize("curve", [None, 9])
def test_weight_dtype_fp8_matches_upstream(loader, tmp_path, monkeypatch, curve, fused):
    import comfy.ldm.minimax_h3.kernels as kernels
    load, reference = loader
    cfg = dict(TINY_CONFIG, adaln_curve_grid=curve)
    path = write_h3_file(tmp_path / "h3.safetensors", cfg, seed=2)
    model = load(path, dtype=FP8)
    if fused:  # the CUDA path (comfy_kitchen's RMSNorm + adaLN, norm weight folded in) on CPU
        monkeypatch.setattr(kernels, "fused_adaln", lambda x: True)

    exact = read_h3_file(path)
    # what UNETLoader's fp8 weight dtype must store: every tensor that follows the model dtype, rounded to fp8
    follows = {k for k, t in MiniMaxH3Model(**cfg, dtype=torch.bfloat16, device="meta").state_dict().items()
               if t.dtype != torch.float32}
    stored = model.state_dict()
    assert {k for k, t in stored.items() if t.dtype == FP8} == follows and len(follows) > 20
    for k in follows:
        assert torch.equal(stored[k].view(torch.uint8), exact[k].to(FP8).view(torch.uint8)), k
    held = {k: v.to(FP8).float() if k in follows else v for k, v in exact.items()}
    _check(model, reference, cfg, held, exact)


@pytest.mark.parametrize("fmt", ["scaled_fp8", "comfy_quant"])
def test_scaled_fp8_file_matches_upstream(loader, tmp_path, fmt):
    from comfy.quant_ops import QuantizedTensor
    load, reference = loader
    cfg = dict(TINY_CONFIG)
    path = write_h3_file(tmp_path / "h3.safetensors", cfg, seed=2, fmt=fmt)
    model = load(path)

    held = read_h3_file(path)  # fp8 * scale
    layers = quantized_layers(cfg)
    modules = dict(model.named_modules())
    scale_key = "scale_weight" if fmt == "scaled_fp8" else "weight_scale"
    with safe_open(str(path), framework="pt", device="cpu") as f:  # the file's own fp8 bits and scales
        for layer in layers:
            w, pre = modules[layer].weight, f"model.diffusion_model.{layer}."
            assert isinstance(w, QuantizedTensor) and modules[layer].quant_format == "float8_e4m3fn", layer
            assert w._qdata.dtype == FP8 and torch.equal(w._qdata.view(torch.uint8), f.get_tensor(pre + "weight").view(torch.uint8))
            assert torch.equal(w._params.scale.float().reshape(()), f.get_tensor(pre + scale_key).float().reshape(()))
    assert len(layers) > 10 and "blocks.0.attn.qkv_proj" in layers and "final_layer.video_out" not in layers
    exact = read_h3_file(write_h3_file(tmp_path / "h3_fp32.safetensors", cfg, seed=2))
    _check(model, reference, cfg, held, exact)
