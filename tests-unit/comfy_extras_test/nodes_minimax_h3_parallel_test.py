"""Overlay: the "MiniMax H3 Sequence Parallel" node on a real ModelPatcher with a real LoRA (CPU, gloo).

The model comes from comfy.sd.load_diffusion_model and the LoRA from comfy.sd.load_lora_for_models
downstream of the node, as in a workflow; the sampler's order of calls (load_models_gpu, pre_run,
forward) is followed. The node's output must equal the same model without the node (fp32,
max |diff| <= 1e-5 relative), and unloading the model must shut the workers down.
"""

import pytest
import torch
from safetensors.torch import save_file

from comfy.ldm.minimax_h3.layout import PackedLayout
from comfy.ldm.minimax_h3.model import SEQUENCE_PARALLEL_OPTION, MiniMaxH3Model
from comfy.ldm.minimax_h3.synthetic import TINY_CONFIG, random_state_dict, step_inputs

pytestmark = pytest.mark.comfyui


def _lora(model, rank=4, seed=5):
    """A LoRA file's state dict in the kohya naming ComfyUI maps onto H3's linears."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, w in model.state_dict().items():
        if name.endswith(("qkv_proj.weight", "out_proj.weight", "fc1.weight", "fc2.weight")):
            stem = "lora_unet_" + name[:-len(".weight")].replace(".", "_")
            sd[stem + ".lora_up.weight"] = torch.randn(w.shape[0], rank, generator=g) * 0.1
            sd[stem + ".lora_down.weight"] = torch.randn(rank, w.shape[1], generator=g) * 0.1
            sd[stem + ".alpha"] = torch.tensor(float(rank))
    return sd


@pytest.fixture
def h3_file(tmp_path):
    model = MiniMaxH3Model(**TINY_CONFIG, dtype=torch.float32)
    path = str(tmp_path / "h3_tiny.safetensors")
    save_file({k: v.contiguous() for k, v in random_state_dict(model, seed=2).items()}, path)
    return path, model


def test_node_matches_the_model_without_it(comfyui_models, h3_file, monkeypatch):
    import comfy.ldm.minimax.model as upstream
    import comfy.model_management
    import comfy.sd
    # what the patch series does: the upstream module re-exports this package's model
    monkeypatch.setattr(upstream, "MiniMaxH3Model", MiniMaxH3Model)
    monkeypatch.setattr(upstream, "PackedLayout", PackedLayout)
    from comfy_extras.nodes_minimax_h3_parallel import MiniMaxH3SequenceParallel, parse_devices

    path, template = h3_file
    base = comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32})
    assert isinstance(base.model.diffusion_model, MiniMaxH3Model)
    lora = _lora(template)
    plain, _ = comfy.sd.load_lora_for_models(base, None, lora, 0.8, 0)
    node_out = MiniMaxH3SequenceParallel.execute(base, "cpu, cpu, cpu").result[0]
    sampled, _ = comfy.sd.load_lora_for_models(node_out, None, lora, 0.8, 0)
    sp = sampled.model_options["transformer_options"][SEQUENCE_PARALLEL_OPTION]
    try:
        outs, synced = [], []
        for patcher in (plain, sampled, base):
            comfy.model_management.load_models_gpu([patcher])
            patcher.pre_run()
            x, t, c, p = step_inputs(TINY_CONFIG, "keyframes", height=5)
            with torch.no_grad():
                outs.append(patcher.model.diffusion_model(
                    x, t, c, transformer_options=dict(patcher.model_options.get("transformer_options", {})),
                    minimax_payload=p))
            synced.append((sp.group.state, sp.synced.key_count if sp.synced else None))
        # ComfyUI unloads the sampled model to load the base one: the workers went with it
        assert synced == [("idle", None), ("ready", len(lora) // 3), ("closed", None)]
        rel = [max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(o, outs[0])) for o in outs[1:]]
        assert rel[0] <= 1e-5  # node + LoRA on 3 ranks == LoRA in one process
        assert rel[1] > 1e-3  # and the LoRA really changes the result

    finally:
        sp.close()
    with pytest.raises(ValueError, match="at least 2"):
        parse_devices("cuda:0")
