"""Patch snapshot cost at real MiniMax H3 shapes on CPU.

The LoRA: rank 32, bfloat16 factors, on the 4 linears (attn.qkv_proj, attn.out_proj, mlp.fc1, mlp.fc2) of all 50 DiT blocks
and both token-refiner blocks: 208 keys, hidden 5376, 56 heads x 128, ffn 14336, loaded by comfy.lora.load_lora onto a real
ModelPatcher around ComfyUI's MiniMaxH3 model (model_base, full size, meta device: rank 0). Timed: capture (hashing every tensor), capture again with the
previous snapshot (no tensor hashed twice), read on a worker (every received tensor hashed against its name), the bytes path
(encode / decode through safetensors), and a strength change (diff: numbers only). The worker side runs ComfyUI's own merge
on the first --apply-blocks DiT blocks (random bfloat16 base weights; all 208 keys are 40 GB): to_patcher (checks + clone +
add_patches) and patch_model(), checked bit for bit against rank 0's own patch_model() of the same patches, and scaled by
52 / blocks.

    PYTHONPATH=.:COMFYUI:scripts/media_site python bench/snapshot_bench.py [--apply-blocks 1] [--repeat 3]
"""

import argparse
import json
import logging
import os
import platform
import resource
import statistics
import time

import torch

from comfy.cli_args import args as cli_args

cli_args.cpu = True

import comfy.lora  # noqa: E402
import comfy.model_patcher  # noqa: E402
import comfy.supported_models  # noqa: E402
from comfy import model_patcher_snapshot as snapshots  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H3 = dict(hidden=5376, heads=56, head_dim=128, ffn=14336, blocks=50, refiner_blocks=2)
P = "diffusion_model."
RANK = 32
CPU = torch.device("cpu")


def h3_lora_shapes():
    inner = H3["heads"] * H3["head_dim"]
    per_block = {"attn.qkv_proj": (3 * inner, H3["hidden"]), "attn.out_proj": (H3["hidden"], inner),
                 "mlp.fc1": (2 * H3["ffn"], H3["hidden"]), "mlp.fc2": (H3["hidden"], H3["ffn"])}
    return {f"{P}{stack}.{i}.{lin}.weight": shape
            for stack, n in (("blocks", H3["blocks"]), ("token_refiner.blocks", H3["refiner_blocks"]))
            for i in range(n) for lin, shape in per_block.items()}


def lora_state_dict(shapes):
    g = torch.Generator().manual_seed(0)
    sd = {}
    for key, (o, i) in shapes.items():
        k = key[:-len(".weight")]
        sd[f"{k}.lora_up.weight"] = (torch.randn(o, RANK, generator=g) * 0.01).to(torch.bfloat16)
        sd[f"{k}.lora_down.weight"] = (torch.randn(RANK, i, generator=g) * 0.01).to(torch.bfloat16)
        sd[f"{k}.alpha"] = torch.tensor(float(RANK))
    return sd


class Holder(torch.nn.Module):
    """What ModelPatcher and comfy.lora read of a model_base.BaseModel."""

    def __init__(self, diffusion_model):
        super().__init__()
        self.diffusion_model = diffusion_model
        self.manual_cast_dtype = None


def weights_module(shapes):
    root = torch.nn.Module()
    g = torch.Generator().manual_seed(1)
    for name, shape in shapes.items():
        owner = root
        *path, leaf = name[len(P):].split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape, generator=g, dtype=torch.bfloat16), requires_grad=False))
    return root


def timed(fn, repeat):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, round(statistics.median(times), 4)


def merged(patcher):
    patcher.patch_model(device_to=CPU)
    out = {k: v.clone() for k, v in patcher.model.diffusion_model.state_dict().items()}
    patcher.unpatch_model(device_to=CPU)
    return out


def bench_worker(loaded, shapes, blocks, repeat):
    subset = {k: s for k, s in shapes.items() if k.startswith(P + "blocks.") and int(k.split(".")[2]) < blocks}
    model = Holder(weights_module(subset))
    rank0 = comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)
    rank0.add_patches({k: loaded[k] for k in subset}, 1.0)
    weaker = comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)
    weaker.add_patches({k: loaded[k] for k in subset}, 0.5)
    first = snapshots.PatchSnapshot.capture(rank0)
    delta = snapshots.PatchSnapshot.capture(weaker, previous=first).diff(first)
    base = comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)
    held = snapshots.read(first.manifest, dict(first.tensors))

    expected, rank0_patch_s = timed(lambda: merged(rank0), repeat)
    worker, to_patcher_s = timed(lambda: held.to_patcher(base, first.digest), repeat)
    got, worker_patch_s = timed(lambda: merged(worker), repeat)
    assert all(torch.equal(got[k].view(torch.uint8), expected[k].view(torch.uint8)) for k in expected), "worker differs from rank 0"
    weaker_held, delta_apply_s = timed(lambda: snapshots.read(delta.manifest, dict(delta.tensors)).apply_to(held), repeat)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(merged(weaker_held.to_patcher(base, delta.digest)).values(), merged(weaker).values()))
    scale = (H3["blocks"] + H3["refiner_blocks"]) / blocks
    return {"measured_keys": len(subset), "worker_matches_rank0_patch_model": True,
            "rank0_patch_model_s": rank0_patch_s, "worker_to_patcher_s": to_patcher_s, "worker_patch_model_s": worker_patch_s,
            "worker_strength_change_read_apply_s": delta_apply_s,
            "extrapolated_208": {"rank0_patch_model_s": round(rank0_patch_s * scale, 1),
                                 "worker_to_patcher_s": round(to_patcher_s * scale, 3),
                                 "worker_patch_model_s": round(worker_patch_s * scale, 1)}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--apply-blocks", type=int, default=1, help="DiT blocks whose base weights the worker side merges (0: skip)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "snapshot_cpu.json"))
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    shapes = h3_lora_shapes()

    t0 = time.perf_counter()
    config = comfy.supported_models.MiniMaxH3({"image_model": "minimax_h3"})
    config.set_inference_dtype(torch.bfloat16, None)
    model = config.get_model({}, device=torch.device("meta"))
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)
    loaded = comfy.lora.load_lora(lora_state_dict(shapes), comfy.lora.model_lora_keys_unet(model, {}))
    assert sorted(loaded) == sorted(shapes), "the LoRA keys did not map onto the H3 model"
    lora = patcher.clone()
    lora.add_patches(loaded, 1.0)
    setup_s = time.perf_counter() - t0

    snap, capture_s = timed(lambda: snapshots.PatchSnapshot.capture(lora), a.repeat)
    _, capture_again_s = timed(lambda: snapshots.PatchSnapshot.capture(lora, previous=snap), a.repeat)
    received = {n: t.clone() for n, t in snap.tensors.items()}  # what a collective hands the worker
    back, read_s = timed(lambda: snapshots.read(json.loads(json.dumps(snap.manifest)), received), a.repeat)
    assert back.version == snap.version
    (text, data), encode_s = timed(snap.encode, a.repeat)
    decoded, decode_s = timed(lambda: snapshots.decode(text, data), a.repeat)
    assert decoded.version == snap.version

    weaker = patcher.clone()
    weaker.add_patches({k: v for k, v in loaded.items() if k.startswith(P + "blocks.0.")}, 0.5)
    weaker.add_patches({k: v for k, v in loaded.items() if not k.startswith(P + "blocks.0.")}, 1.0)
    snap2 = snapshots.PatchSnapshot.capture(weaker, previous=snap)
    delta, diff_s = timed(lambda: snap2.diff(snap), a.repeat)
    assert delta.tensors == {} and len(delta.patches) == 4

    result = {
        "benchmark": "patch snapshot, 208-key rank-32 LoRA at MiniMax H3 shapes",
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version(), "platform": platform.platform()},
        "patcher": "comfy.model_patcher.ModelPatcher around comfy.supported_models.MiniMaxH3's model on the meta device, LoRA through comfy.lora.load_lora",
        "lora": {"keys": len(snap.patches), "rank": RANK, "factor_dtype": "bfloat16", **snap.describe(), "shapes": H3},
        "median_of": a.repeat,
        "setup_s": round(setup_s, 2),
        "snapshot": {"capture_s": capture_s, "capture_again_with_previous_s": capture_again_s, "worker_read_s": read_s,
                     "manifest_json_bytes": len(json.dumps(snap.manifest)), "digest": snap.digest},
        "bytes_path": {"encode_s": encode_s, "decode_s": decode_s, "safetensors_bytes": len(data)},
        "strength_change_one_block": {"changed_keys": len(delta.patches), "diff_s": diff_s,
                                      "manifest_json_bytes": len(json.dumps(delta.manifest)), "tensor_bytes": 0},
        **({"worker": bench_worker(loaded, shapes, a.apply_blocks, a.repeat)} if a.apply_blocks > 0 else {}),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "notes": [
            "capture hashes every tensor once (sha256, 4 threads); capture with previous hashes only tensors previous lacks; "
            "read hashes every received tensor against its name; the tensors themselves are sent as tensors",
            "worker side: to_patcher checks the digest, keys and shapes, clones the base ModelPatcher and calls add_patches; "
            "patch_model() is ComfyUI's own merge; both bit for bit against rank 0's patch_model(); CPU merge times are "
            "dominated by page faults on fresh allocations on this machine: compare worker_patch_model_s with "
            "rank0_patch_model_s, not as absolute numbers",
        ],
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
        f.write("\n")
    logging.info("%s", json.dumps({k: result[k] for k in ("snapshot", "bytes_path", "strength_change_one_block")}, indent=2))
    logging.info("wrote %s", a.out)


if __name__ == "__main__":
    main()
