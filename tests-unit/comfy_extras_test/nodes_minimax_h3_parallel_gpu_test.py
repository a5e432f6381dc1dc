"""The node's CUDA path on one GPU: two ranks share cuda:0 (ComfyUI reports the GPU twice), so the
group's CUDA data path runs as it does between two GPUs (device to device where its write-and-verify
test passes, here within one GPU; else through pinned host memory), with
ComfyUI's loader, a LoRA and KSampler, against the same workflow without the node.

Tolerance: bf16 weights computing in bf16 on the GPU; sharding changes which rank computes which rows
and heads, so GEMMs block differently: max |diff| <= 2e-2 * max |native|, while the LoRA moves the
output by more (asserted).
"""

import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the node's worker processes run on Linux")]

import comfy.model_management  # noqa: E402
import comfy.patcher_extension  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from h3_files import TINY_CONFIG, lora_state_dict, write_h3_file  # noqa: E402

TOL = 2e-2


@pytest.fixture
def models(tmp_path, monkeypatch):
    import folder_paths
    for kind in ("diffusion_models", "loras"):
        (tmp_path / kind).mkdir()
        monkeypatch.setitem(folder_paths.folder_names_and_paths, kind, ([str(tmp_path / kind)], folder_paths.supported_pt_extensions))
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    gpu = comfy.model_management.get_torch_device()
    monkeypatch.setattr(comfy.model_management, "get_all_torch_devices", lambda exclude_current=False: [gpu, gpu])
    write_h3_file(str(tmp_path / "diffusion_models" / "h3.safetensors"), TINY_CONFIG, seed=2, dtype=torch.bfloat16)
    save_file(lora_state_dict(TINY_CONFIG), str(tmp_path / "loras" / "lora.safetensors"))
    yield
    comfy.model_management.unload_all_models()


def sample(model, steps=3, cfg=2.5):
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV
    latent = EmptyMiniMaxH3LatentAV.execute(64, 64, 9).result[0]
    g = torch.Generator().manual_seed(3)
    positive = [[torch.randn(1, 9, TINY_CONFIG["text_dim"], generator=g), {}]]
    negative = [[torch.randn(1, 6, TINY_CONFIG["text_dim"], generator=g), {}]]
    out = nodes.common_ksampler(model, 7, steps, cfg, "euler", "simple", positive, negative, latent)[0]["samples"]
    return [t.float() for t in (out.unbind() if out.is_nested else [out])]


def rel(a, b):
    return max(float((u - v).abs().max() / v.abs().max()) for u, v in zip(a, b))


def test_two_ranks_sharing_one_gpu_match_the_workflow_without_the_node(models):
    import nodes
    from comfy_extras.nodes_minimax_h3_parallel import KEY, MiniMaxH3SequenceParallel
    base = nodes.UNETLoader().load_unet("h3.safetensors", "default")[0]
    node = MiniMaxH3SequenceParallel.execute(base, 2, False).result[0]
    sp = node.get_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY)[0]

    def lora(model):
        return nodes.LoraLoaderModelOnly().load_lora_model_only(model, "lora.safetensors", 0.8)[0]
    try:
        native, native_lora = sample(base), sample(lora(base))
        sharded, sharded_lora = sample(node), sample(lora(node))
        assert [str(d) for d in sp.devices] == ["cuda:0", "cuda:0"] and sp.steps_run == 2 * 2 * 3
    finally:
        sp.close()
    diffs = {"sharded": rel(sharded, native), "sharded_lora": rel(sharded_lora, native_lora), "lora_effect": rel(native_lora, native)}
    assert diffs["sharded"] <= TOL and diffs["sharded_lora"] <= TOL and diffs["lora_effect"] > 2 * TOL, diffs
