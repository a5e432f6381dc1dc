"""PatchSnapshot cost at real MiniMax H3 shapes on CPU, against torch.save of the same patches dict.

The LoRA: rank 32, bfloat16 factors, on the 4 linears (attn.qkv_proj, attn.out_proj, mlp.fc1,
mlp.fc2) of all 50 DiT blocks and both token-refiner blocks: 52 x 4 = 208 keys, hidden 5376,
56 heads x 128, ffn 14336.

Capture, encode and decode run on the full 208-key snapshot. The worker side is ComfyUI's own: the
snapshot becomes a clone of the worker's unpatched base ModelPatcher (``snap.to_patcher(base)``) and
ComfyUI's ``patch_model()`` merges it, ``unpatch_model()`` restores the base. That needs the base
weights of the keys it touches: all 208 are 20 G parameters (40 GB in bfloat16), more than this
machine holds, so the worker side is measured on the first --apply-blocks DiT blocks (bfloat16 base
weights, random) and scaled by 52 / blocks (every block has the same shapes); rank 0's own
patch_model() of the downstream ModelPatcher on the same weights is timed for scale, and the
worker's merged weights are checked bit for bit against it. With COMFYUI_DIR set the patcher is a
real ModelPatcher around a meta-device MiniMaxH3Model and the LoRA goes through comfy.lora.load_lora;
without it, a stand-in patcher, and the worker side (which is ComfyUI) is skipped.

    python bench/snapshot_bench.py [--apply-blocks 4] [--repeat 3] [--out bench/results/snapshot_cpu.json]
"""

import argparse
import hashlib
import io
import json
import os
import platform
import resource
import statistics
import sys
import time
import types
import uuid

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from comfy.model_patcher_snapshot import PatchSnapshot, decode  # noqa: E402

H3 = dict(hidden=5376, heads=56, head_dim=128, ffn=14336, blocks=50, refiner_blocks=2)
PREFIX = "diffusion_model."
RANK = 32


def h3_lora_shapes():
    inner = H3["heads"] * H3["head_dim"]
    per_block = {"attn.qkv_proj": (3 * inner, H3["hidden"]), "attn.out_proj": (H3["hidden"], inner),
                 "mlp.fc1": (2 * H3["ffn"], H3["hidden"]), "mlp.fc2": (H3["hidden"], H3["ffn"])}
    return {f"{PREFIX}{stack}.{i}.{lin}.weight": shape
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


def comfyui_patcher(comfyui_dir, shapes):
    sys.path.append(comfyui_dir)
    from comfy.cli_args import args
    args.cpu = True
    # comfy.model_base imports torchvision for unrelated models; the test suite's stand-in covers
    # this CPU environment, which has none
    sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests-unit"))
    import absent_media_packages
    absent_media_packages.install()
    import comfy.ldm.minimax.model
    import comfy.lora
    import comfy.model_patcher
    import comfy.ops

    base = torch.nn.Module()
    base.diffusion_model = comfy.ldm.minimax.model.MiniMaxH3Model(dtype=torch.bfloat16, device="meta", operations=comfy.ops.disable_weight_init)
    base.model_config = types.SimpleNamespace(unet_config={})
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    loaded = comfy.lora.load_lora(lora_state_dict(shapes), comfy.lora.model_lora_keys_unet(base, {}))
    assert sorted(loaded) == sorted(shapes), "LoRA keys did not map onto the H3 model"
    lora = patcher.clone()
    lora.add_patches(loaded, 1.0)
    return patcher, lora, loaded, "comfy.model_patcher.ModelPatcher (meta-device MiniMaxH3Model)", comfy.model_patcher.ModelPatcher


class _Adapter:
    name = "lora"

    def __init__(self, weights):
        self.weights = weights
        self.loaded_keys = set()


class _Patcher:
    """ModelPatcher's public patch attributes, for runs without ComfyUI."""

    def __init__(self, shapes):
        self.keys = {k: None for k in shapes}
        self.patches, self.object_patches, self.hook_patches = {}, {}, {}
        self.weight_wrapper_patches, self.injections, self.force_cast_weights = {}, {}, False
        self.patches_uuid = uuid.uuid4()

    def model_state_dict(self):
        return self.keys

    def clone(self):
        c = _Patcher(self.keys)
        c.patches = {k: list(v) for k, v in self.patches.items()}
        return c

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        for k, v in patches.items():
            self.patches.setdefault(k, []).append((strength_patch, v, strength_model, None, None))
        self.patches_uuid = uuid.uuid4()


def standin_patcher(shapes):
    sd = lora_state_dict(shapes)
    loaded = {}
    for key in shapes:
        k = key[:-len(".weight")]
        loaded[key] = _Adapter((sd[f"{k}.lora_up.weight"], sd[f"{k}.lora_down.weight"], sd[f"{k}.alpha"].item(), None, None, None))
    patcher = _Patcher(shapes)
    lora = patcher.clone()
    lora.add_patches(loaded, 1.0)
    return patcher, lora, loaded, "stand-in (no ComfyUI)", None


def timed(fn, repeat):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def weights_module(shapes):
    root = torch.nn.Module()
    g = torch.Generator().manual_seed(1)
    for name, shape in shapes.items():
        owner = root
        *path, leaf = name[len(PREFIX):].split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape, generator=g, dtype=torch.bfloat16), requires_grad=False))
    return root


def _fingerprint(model):
    """sha256 of every weight's raw bytes (bfloat16 has no numpy view: go through uint8)."""
    return {k: hashlib.sha256(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in model.state_dict().items()}


def bench_worker(patcher, loaded, shapes, blocks, comfy_patcher_cls, repeat):
    """The worker side on the first ``blocks`` DiT blocks: to_patcher + ComfyUI's patch_model/unpatch_model."""
    cpu = torch.device("cpu")
    subset = {k: s for k, s in shapes.items() if k.startswith(PREFIX + "blocks.") and int(k.split(".")[2]) < blocks}
    first = patcher.clone()
    first.add_patches({k: loaded[k] for k in subset}, 1.0)
    weaker = patcher.clone()
    weaker.add_patches({k: loaded[k] for k in subset}, 0.5)
    snap = PatchSnapshot.capture(first)
    snap_weaker = PatchSnapshot.capture(weaker, previous=snap)
    delta = snap_weaker.diff(snap)
    assert delta.describe()["tensor_bytes"] == 0, "a strength change should send no tensor bytes"
    # the held snapshot as a worker holds it: decoded from bytes
    held = decode(snap.encode())

    holder = torch.nn.Module()
    holder.diffusion_model = weights_module(subset)
    holder.model_config = types.SimpleNamespace(unet_config={})
    base_fp = _fingerprint(holder)
    # rank 0: the downstream ModelPatcher ComfyUI samples with, on the same weights
    rank0 = comfy_patcher_cls(holder, load_device=cpu, offload_device=cpu)
    rank0.add_patches({k: loaded[k] for k in subset}, 1.0)
    # the worker: an unpatched base ModelPatcher of the same model, as headless ComfyUI builds it
    base = comfy_patcher_cls(holder, load_device=cpu, offload_device=cpu)

    timings, backup = {}, None

    def timed_once(name, fn):
        t = time.perf_counter()
        out = fn()
        timings.setdefault(name, []).append(time.perf_counter() - t)
        return out

    def strength_change(patched):
        # a strength change on a patched worker: the delta onto the held snapshot, unpatch, rebuild, merge
        patched.unpatch_model(device_to=cpu)
        changed = delta.apply_to(held).to_patcher(base)
        changed.patch_model(device_to=cpu)
        return changed

    for r in range(repeat):
        timed_once("comfyui_patch_model", lambda: rank0.patch_model(device_to=cpu))
        if r == 0:
            reference = _fingerprint(holder)
            assert reference != base_fp
        timed_once("comfyui_unpatch_model", lambda: rank0.unpatch_model(device_to=cpu))

        worker = timed_once("to_patcher", lambda: held.to_patcher(base))
        timed_once("worker_patch_model", lambda: worker.patch_model(device_to=cpu))
        if r == 0:
            backup = sum(b.weight.numel() * b.weight.element_size() for b in worker.backup.values())
            assert _fingerprint(holder) == reference, "worker weights differ from rank 0's patch_model()"
        worker = timed_once("worker_strength_change", lambda w=worker: strength_change(w))
        timed_once("worker_unpatch_model", lambda: worker.unpatch_model(device_to=cpu))
        if r == 0:
            assert _fingerprint(holder) == base_fp, "unpatch_model() did not restore the base weights"
    scale = (H3["blocks"] + H3["refiner_blocks"]) / blocks
    median = {k: statistics.median(v) for k, v in timings.items()}
    return {
        "arithmetic": "comfyui",
        "measured_keys": len(subset),
        "worker_matches_rank0_patch_model": True,
        "strength_change_delta_tensor_bytes": delta.describe()["tensor_bytes"],
        "backup_bytes_measured": backup,
        "backup_bytes_208": sum(o * i * 2 for o, i in shapes.values()),
        # 4 decimals: to_patcher takes well under a millisecond
        **{f"{k}_s_measured": round(v, 4) for k, v in median.items()},
        **{f"{k}_s_extrapolated_208": round(v * scale, 1) for k, v in median.items()},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--apply-blocks", type=int, default=4,
                    help="DiT blocks whose base weights are materialised for the worker-side patch_model (0: skip it)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_DIR") or "", help="ComfyUI checkout (default: $COMFYUI_DIR)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "snapshot_cpu.json"))
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    shapes = h3_lora_shapes()
    assert len(shapes) == 208

    t0 = time.perf_counter()
    if a.comfyui:
        patcher, lora, loaded, kind, patcher_cls = comfyui_patcher(a.comfyui, shapes)
    else:
        patcher, lora, loaded, kind, patcher_cls = standin_patcher(shapes)
    setup = time.perf_counter() - t0

    snap, capture_s = timed(lambda: PatchSnapshot.capture(lora), a.repeat)
    blob, encode_s = timed(snap.encode, a.repeat)
    back, decode_s = timed(lambda: decode(blob), a.repeat)
    assert back.digest == snap.digest and back.encode() == blob

    def save():
        buf = io.BytesIO()
        torch.save(lora.patches, buf)
        return buf.getvalue()

    pickled, save_s = timed(save, a.repeat)
    # weights_only=False: the adapter objects are pickled classes; exactly what workers must never load
    _, load_s = timed(lambda: torch.load(io.BytesIO(pickled), weights_only=False), a.repeat)

    strength = lora.clone()
    changed = [k for k in shapes if k.startswith(PREFIX + "blocks.0.")]
    for k in changed:
        s, v, sm, off, fn = strength.patches[k][0]
        strength.patches[k] = [(0.5, v, sm, off, fn)]
    strength.patches_uuid = uuid.uuid4()
    snap2 = PatchSnapshot.capture(strength, previous=snap)
    delta, diff_s = timed(lambda: snap2.diff(snap), a.repeat)
    delta_blob, delta_encode_s = timed(delta.encode, a.repeat)
    assert delta.describe()["tensor_bytes"] == 0

    apply = None
    if patcher_cls is not None and a.apply_blocks > 0:
        apply = bench_worker(patcher, loaded, shapes, a.apply_blocks, patcher_cls, a.repeat)

    result = {
        "benchmark": "patch snapshot, 208-key rank-32 LoRA at MiniMax H3 shapes",
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version(), "platform": platform.platform()},
        "patcher": kind,
        "lora": {"keys": snap.key_count, "rank": RANK, "factor_dtype": "bfloat16", "tensors": len(snap.tensors),
                 "tensor_bytes": snap.describe()["tensor_bytes"], "shapes": H3},
        "median_of": a.repeat,
        "setup_s": round(setup, 2),
        "snapshot": {"capture_s": round(capture_s, 3), "encode_s": round(encode_s, 3), "decode_s": round(decode_s, 3),
                     "bytes": len(blob), "manifest_bytes": len(snap.manifest_bytes), "digest": snap.digest},
        "torch_save_patches_dict": {"save_s": round(save_s, 3), "bytes": len(pickled), "load_s_weights_only_false": round(load_s, 3)},
        "delta_strength_change_one_block": {"changed_keys": len(delta.patches), "diff_s": round(diff_s, 4),
                                            "encode_s": round(delta_encode_s, 4), "bytes": len(delta_blob),
                                            "tensor_bytes": delta.describe()["tensor_bytes"]},
        **({"apply": apply} if apply is not None else {}),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "notes": [
            "capture hashes every tensor once (sha256); decode verifies every tensor's hash and the manifest digest; "
            "encode copies the tensor bytes into one canonical byte string",
            "CPU timings on this machine are dominated by page faults on large fresh allocations (see system vs user time): "
            "read worker_patch_model against comfyui_patch_model (rank 0's own merge of the same patches on the same "
            "weights), not as absolute numbers; on a GPU worker the merge runs on the device",
            *([f"worker side measured on {apply['measured_keys']} keys (first {a.apply_blocks} DiT blocks, bfloat16 base "
               "weights, random values); the _208 figures scale them by 52 / measured blocks (every block has the same shapes)",
               "the worker merges with ComfyUI itself: to_patcher builds a clone of its unpatched base ModelPatcher, "
               "worker_patch_model is that clone's patch_model() (backing up each touched weight, as ComfyUI does), "
               "worker_strength_change is unpatch_model() + delta.apply_to + to_patcher + patch_model() at strength 0.5; "
               "the worker's merged weights were checked bit for bit against rank 0's patch_model()"]
              if apply is not None else ["no worker-side measurement: it runs ComfyUI's ModelPatcher (set COMFYUI_DIR)"]),
            "torch.save/torch.load(weights_only=False) of ModelPatcher.patches is the pickle baseline; workers never do that",
        ],
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
        f.write("\n")
    print(json.dumps({k: result.get(k) for k in ("snapshot", "torch_save_patches_dict", "delta_strength_change_one_block", "apply")}, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
