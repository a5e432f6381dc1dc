"""LoRA changes at MiniMax H3 scale on one GPU: a sequence-parallel worker's path beside ComfyUI's own.

The model: MiniMax H3 at real size (33.1 B parameters, bf16, random weights made on the GPU: no
62 GiB checkpoint fits the device's disk), built the way ComfyUI's loader builds it
(model_detection -> model_base.MiniMaxH3 -> ModelPatcher with ComfyUI's load and offload devices).
The LoRAs: rank 32, bf16 factors, on qkv/out/fc1/fc2 of every DiT and token-refiner block (208 keys),
through comfy.lora.load_lora. Each role runs in its own process, so peak host RSS (VmHWM) is per role:

  --role worker  what a worker runs per change, after rank 0 captured and encoded it: decode, apply the
                 delta to the held snapshot, snapshot.load(base) (ComfyUI's load_models_gpu, backups on
                 the GPU when free memory allows), headless.describe(); for first load, strength change
                 (1.0 -> 0.5), LoRA swap and clear, --reps times. Also: merged weights of sample keys
                 against ComfyUI's patch_weight_to_device, bit for bit; the per-step forward at
                 832x480x124 with base weights, merged weights and forward-time patches (ComfyUI's
                 LowVramPatch on the 208 linears, the work DynamicVRAM adds to every step), interleaved;
                 restoring weights from a memory-mapped safetensors file of --mmap-blocks blocks.
  --role rank0   ComfyUI's own path, which rank 0 runs (and workers ran before): patch_model() and
                 unpatch_model() called directly, as in the issue; then load_models_gpu of a clone
                 holding the LoRA for the same four changes.

    python bench/lora_sync_bench.py --role worker --comfyui DIR --out worker.json
    python bench/lora_sync_bench.py --role rank0 --comfyui DIR --out rank0.json
    python bench/lora_sync_bench.py --merge worker.json rank0.json --out bench/results/lora_sync_h200.json
  --dry-run: a tiny H3 on the CPU, to check the script itself.

bench/results/lora_sync_h200.json: one H200 (torch 2.11+cu130), both roles with the defaults, one after the
other in one device session, the ComfyUI tree of the pinned base and comfy-kitchen / comfy-aimdo on the path.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK = 32
TINY = dict(hidden_size=64, num_layers=2, token_refiner_num_layers=1, num_attention_heads=4, attention_head_dim=16,
            ffn_hidden_size=96, text_dim=32, timestep_input_dim=32, time_embed_hidden_size=64, time_embed_dim=32,
            rope_inv_freq_len=2)
LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
GIB = 1024 ** 3


def setup_comfyui(comfyui, dry_run):
    # this repository's comfy/ files, then the H3 re-export, then ComfyUI (comfy is a namespace package)
    sys.path[:0] = [ROOT, os.path.join(ROOT, "patches", "overlay")]
    sys.path.append(comfyui)
    sys.path.append(os.path.join(ROOT, "bench"))
    if dry_run:
        sys.path.append(os.path.join(ROOT, "scripts"))
        import absent_media_packages
        absent_media_packages.install()
        from comfy.cli_args import args
        args.cpu = True


def proc_status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def gpu_memory():
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"allocated_gib": round(torch.cuda.memory_allocated() / GIB, 2), "free_gib": round(free / GIB, 2),
            "total_gib": round(total / GIB, 2)}


def build(dry_run):
    """model_detection config -> model_base.MiniMaxH3 on the load device -> ModelPatcher, as comfy.sd does."""
    import comfy.model_detection
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.ops
    from comfy.ldm.minimax_h3.model import MiniMaxH3Model
    cfg = TINY if dry_run else {}
    shapes = MiniMaxH3Model(**cfg, dtype=torch.bfloat16, device="meta", operations=comfy.ops.disable_weight_init).state_dict()
    config = comfy.model_detection.model_config_from_unet(shapes, "")
    config.set_inference_dtype(torch.bfloat16, None)
    device = mm.get_torch_device()
    model = config.get_model(shapes, "", device=device)
    with torch.no_grad():
        if device.type == "cuda":
            from h3_gpu_common import init_random_
            init_random_(model.diffusion_model)
        else:
            for t in model.diffusion_model.state_dict().values():
                t.normal_(0.0, 0.02)
    model.requires_grad_(False)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=mm.unet_offload_device())
    n = sum(p.numel() for p in model.diffusion_model.parameters())
    return patcher, {"parameters": n, "weights_gib": round(mm.module_size(model) / GIB, 2), "load_device": str(device),
                     "offload_device": str(patcher.offload_device), "blocks": len(model.diffusion_model.blocks)}


def lora(patcher, seed):
    """A rank-32 LoRA on the 4 linears of every block, in ComfyUI's loaded form: {key: LoRAAdapter}."""
    import comfy.lora
    import comfy.utils
    dm = patcher.model.diffusion_model
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for stack, n in (("blocks", len(dm.blocks)), ("token_refiner.blocks", len(dm.token_refiner.blocks))):
        for i in range(n):
            for lin in LINEARS:
                k = f"diffusion_model.{stack}.{i}.{lin}"
                o, d = comfy.utils.get_attr(patcher.model, k + ".weight").shape
                sd[k + ".lora_up.weight"] = (torch.randn(o, RANK, generator=g) * 0.01).to(torch.bfloat16)
                sd[k + ".lora_down.weight"] = (torch.randn(RANK, d, generator=g) * 0.01).to(torch.bfloat16)
                sd[k + ".alpha"] = torch.tensor(float(RANK))
    loaded = comfy.lora.load_lora(sd, comfy.lora.model_lora_keys_unet(patcher.model, {}))
    assert len(loaded) == 4 * (len(dm.blocks) + len(dm.token_refiner.blocks)), "LoRA keys did not map onto the model"
    return loaded


def with_loras(base, loras):
    p = base.clone()
    for loaded, strength in loras:
        p.add_patches(loaded, strength)
    return p


def inputs(dm, dry_run, device):
    from h3_gpu_common import latent_shapes
    h, w, f = (64, 64, 22) if dry_run else (480, 832, 124)
    vs, as_ = latent_shapes(h, w, f)
    g = torch.Generator(device).manual_seed(0)
    video = torch.randn(vs, generator=g, device=device)
    audio = torch.randn(as_, generator=g, device=device)
    # refined text (extra_conds refines it once per sampling run, outside the steps)
    context = torch.randn(1, 512, dm.hidden_size, generator=g, device=device).to(torch.bfloat16)
    return [video, audio], torch.tensor([600.0], device=device), context


def steps(a, b):
    return [("first_load", [(a, 1.0)]), ("strength_change", [(a, 0.5)]), ("swap", [(b, 1.0)]), ("clear", [])]


def median(xs):
    return round(statistics.median(xs), 4)


def role_worker(a, out, save):
    import comfy.model_management as mm
    import comfy.sd  # noqa: F401 (headless.describe hashes its source)
    import comfy.utils
    from comfy.model_patcher import LowVramPatch
    from comfy.model_patcher_snapshot import PatchSnapshot, decode
    from comfy.parallel import headless

    base, out["model"] = build(a.dry_run)
    dev = base.load_device
    out["rss_after_build"] = proc_status()
    held = PatchSnapshot.empty()
    _, out["initial_load_s"] = timed(lambda: held.load(base))  # the worker's start: empty snapshot, model on the device
    lora_a, lora_b = lora(base, 1), lora(base, 2)
    dm = base.model.diffusion_model
    sample = [f"diffusion_model.blocks.{len(dm.blocks) // 2}.{lin}.weight" for lin in LINEARS] + \
             ["diffusion_model.token_refiner.blocks.0.mlp.fc1.weight"]
    # ComfyUI's own merge of the sample keys, computed from the base weights before any worker load
    refs = {"clear": {k: comfy.utils.get_attr(base.model, k).clone() for k in sample}}
    for name, loras in steps(lora_a, lora_b)[:3]:
        r0 = with_loras(base, loras)
        refs[name] = {k: r0.patch_weight_to_device(k, device_to=dev, return_weight=True) for k in sample}
    save()

    rows, prev, patcher = [], None, None
    for rep in range(a.reps):
        for name, loras in steps(lora_a, lora_b):
            r0 = with_loras(base, loras)
            t = time.perf_counter()
            snap = PatchSnapshot.capture(r0, previous=prev)
            update = snap if prev is None else snap.diff(prev)
            blob = update.encode()
            rank0_capture_encode_s = time.perf_counter() - t
            prev = snap
            sync()
            t0 = time.perf_counter()
            u = decode(blob)
            t1 = time.perf_counter()
            held = u if u.kind == "snapshot" else u.apply_to(held)
            t2 = time.perf_counter()
            patcher = held.load(base)
            sync()
            t3 = time.perf_counter()
            headless.describe(patcher)
            t4 = time.perf_counter()
            same = all(torch.equal(comfy.utils.get_attr(base.model, k).view(torch.uint16), refs[name][k].view(torch.uint16))
                       for k in sample)
            assert same, f"{name}: worker weights differ from ComfyUI's patch_weight_to_device"
            backups = list(patcher.backup.values())
            rows.append({"rep": rep, "step": name, "bytes_sent": len(blob), "tensor_bytes_sent": update.describe()["tensor_bytes"],
                         "rank0_capture_encode_s": round(rank0_capture_encode_s, 4), "decode_s": round(t1 - t0, 4),
                         "apply_delta_s": round(t2 - t1, 4), "load_s": round(t3 - t2, 4), "describe_s": round(t4 - t3, 4),
                         "worker_total_s": round(t4 - t0, 4), "backup_device": str(patcher.offload_device),
                         "backup_gib": round(sum(b.weight.nelement() * b.weight.element_size() for b in backups) / GIB, 2),
                         "backups_on_host": sum(b.weight.device.type == "cpu" for b in backups),
                         "matches_comfyui_sample_keys": same, **gpu_memory(), **proc_status()})
            print(json.dumps(rows[-1]), flush=True)
        out["changes"] = rows
        save()
    out["changes_median"] = {name: {f: median([r[f] for r in rows if r["step"] == name])
                                    for f in ("worker_total_s", "decode_s", "apply_delta_s", "load_s", "describe_s",
                                              "rank0_capture_encode_s", "tensor_bytes_sent", "bytes_sent")}
                             for name, _ in steps(None, None)}
    del refs
    save()

    # per-step cost: base, merged (worker path) and forward-time patches on the base weights, interleaved
    x, t, c = inputs(dm, a.dry_run, dev)
    from comfy.ldm.minimax_h3.layout import PackedLayout
    payload = {"layout": PackedLayout(c.shape[1], x[0].shape[2], x[0].shape[3], x[0].shape[4], x[1].shape[-1]), "seed": 0}
    out["step"] = {"resolution": "64x64x22" if a.dry_run else "832x480x124", "tokens": payload["layout"].seq_len}

    def forward():
        with torch.no_grad():
            return dm._forward(x, t, c, {}, minimax_payload=payload)

    def set_state(kind):
        nonlocal held
        target = PatchSnapshot.capture(with_loras(base, [(lora_a, 1.0)] if kind == "merged" else []))
        held = target
        p = target.load(base)
        if kind == "forward_time_patches":
            r0 = with_loras(base, [(lora_a, 1.0)])
            for key in r0.patches:
                comfy.utils.get_attr(base.model, key.rsplit(".", 1)[0]).weight_function = [LowVramPatch(key, r0.patches)]
        return p

    def clear_functions():
        for key in lora_a:
            comfy.utils.get_attr(base.model, key.rsplit(".", 1)[0]).weight_function = []

    set_state("base")
    forward()  # warm-up
    times = {"base": [], "merged": [], "forward_time_patches": []}
    outs = {}
    for r in range(a.step_reps):
        for kind in times:
            set_state(kind)
            o, s = timed(forward)
            times[kind].append(round(s, 4))
            if r == 0:
                outs[kind] = [v.float().cpu() for v in o]
            clear_functions()
        out["step"]["times_s"] = times
        save()
    b = median(times["base"])
    out["step"].update({f"{k}_median_s": median(v) for k, v in times.items()})
    out["step"].update({f"{k}_overhead_pct": round(100 * (median(v) - b) / b, 2) for k, v in times.items() if k != "base"})
    # the same merge applied once (merged) or every call (forward-time): outputs agree to bf16 rounding
    out["step"]["merged_vs_forward_time_rel_diff"] = max(
        float((u - v).abs().max() / v.abs().max()) for u, v in zip(outs["merged"], outs["forward_time_patches"]))
    del outs
    out["rss_before_mmap"] = proc_status()
    save()

    # mmap-restore candidate: base weights of N blocks' patched keys from a safetensors file (page cache)
    if a.mmap_blocks:
        import safetensors.torch
        from safetensors import safe_open
        keys = [f"diffusion_model.blocks.{i}.{lin}.weight" for i in range(a.mmap_blocks) for lin in LINEARS]
        path = os.path.join(a.tmp, "lora_sync_mmap.safetensors")
        safetensors.torch.save_file({k: comfy.utils.get_attr(base.model, k).cpu() for k in keys}, path)
        try:
            nbytes = os.path.getsize(path)
            with open(path, "rb") as f:  # warm the page cache, as ranks sharing one file would
                while f.read(64 << 20):
                    pass

            def restore():
                with safe_open(path, framework="pt", device="cpu") as f:
                    for k in keys:
                        comfy.utils.get_attr(base.model, k).copy_(f.get_tensor(k))

            _, s = timed(restore)
            _, s2 = timed(restore)
            n208 = 4 * (len(dm.blocks) + len(dm.token_refiner.blocks))
            out["mmap_restore"] = {"keys": len(keys), "file_bytes": nbytes, "restore_s": [round(s, 3), round(s2, 3)],
                                   "gb_per_s": round(nbytes / min(s, s2) / 1e9, 2),
                                   "restore_s_extrapolated_208": round(min(s, s2) * n208 / len(keys), 2)}
        finally:
            os.remove(path)
    out["peak"] = {**proc_status(), "gpu_max_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2)
                   if torch.cuda.is_available() else None}
    mm.unload_all_models()


def role_rank0(a, out, save):
    import comfy.model_management as mm

    base, out["model"] = build(a.dry_run)
    dev = base.load_device
    out["rss_after_build"] = proc_status()
    lora_a, lora_b = lora(base, 1), lora(base, 2)

    def host_backup_gib(p):
        return round(sum(b.weight.nelement() * b.weight.element_size() for b in p.backup.values()
                         if b.weight.device.type == "cpu") / GIB, 2)

    # as the issue measured it: ModelPatcher.patch_model() / unpatch_model() on the resident model
    direct = out["direct"] = {}
    p = with_loras(base, [(lora_a, 1.0)])
    _, s = timed(lambda: p.patch_model(device_to=dev))
    direct.update(patch_model_s=round(s, 3), host_backup_gib=host_backup_gib(p))
    _, s = timed(lambda: p.unpatch_model(device_to=dev))
    direct["unpatch_model_s"] = round(s, 3)
    p.patch_model(device_to=dev)
    weaker = with_loras(base, [(lora_a, 0.5)])
    _, s = timed(lambda: (p.unpatch_model(device_to=dev), weaker.patch_model(device_to=dev)))
    direct["strength_change_s"] = round(s, 3)
    weaker.unpatch_model(device_to=dev)
    direct.update(proc_status())
    print(json.dumps(direct), flush=True)
    save()

    # rank 0's path in ComfyUI: load_models_gpu of the downstream clone
    rows = []
    for rep in range(a.rank0_reps):
        for name, loras in steps(lora_a, lora_b):
            p = with_loras(base, loras)
            _, s = timed(lambda: mm.load_models_gpu([p]))
            rows.append({"rep": rep, "step": name, "load_models_gpu_s": round(s, 3), "host_backup_gib": host_backup_gib(p),
                         **gpu_memory(), **proc_status()})
            print(json.dumps(rows[-1]), flush=True)
            out["load_models_gpu"] = rows
            save()
    # no unload at the end: ComfyUI's would move the whole model to the host first
    out["peak"] = proc_status()


def merge(paths, out_path):
    parts = {}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        parts[d["role"]] = d
    result = {"benchmark": "LoRA changes at MiniMax H3 scale: sequence-parallel worker path vs ComfyUI's own patch_model",
              "machine": parts["worker"]["machine"], "lora": parts["worker"]["lora"], "model": parts["worker"]["model"],
              "worker": {k: v for k, v in parts["worker"].items() if k not in ("machine", "lora", "model", "role")},
              "comfyui_rank0": {k: v for k, v in parts["rank0"].items() if k not in ("machine", "lora", "model", "role")},
              "notes": NOTES}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
        f.write("\n")


NOTES = [
    "worker and rank0 ran one after the other, each in its own process on the same GPU (two 62 GiB models and the "
    "worker's backups do not fit one H200 at once); overlapped, a change is in force on every rank after "
    "max(rank 0, worker) plus the message; in today's node flow (sync at ON_PRE_RUN, after rank 0 loaded) after their sum",
    "worker_total_s = decode (sha256 of every received tensor) + delta.apply_to + snapshot.load(base) + headless.describe; "
    "the transport of the encoded bytes between processes is not included",
    "forward_time_patches: ComfyUI's LowVramPatch as weight_function on the 208 patched linears with the weights "
    "resident, i.e. the patch arithmetic DynamicVRAM runs in every step; DynamicVRAM itself (comfy-aimdo) was not run",
    "mmap_restore: the patched weights of the first N blocks copied from a page-cached safetensors file into the "
    "model's GPU weights, extrapolated to 208 keys; the merge would come on top",
    "merged_vs_forward_time_rel_diff: ComfyUI's merge computes in lora_compute_dtype and rounds to bf16 once, "
    "LowVramPatch computes in the weight's dtype at every call; on random weights the two paths' outputs differ by "
    "this much (max |diff| / max |out|). The worker's merged weights equal ComfyUI's patch_weight_to_device bit for bit "
    "(matches_comfyui_sample_keys) and rank 0's patch_model on CUDA (tests-unit/comfy_test/model_patcher_snapshot_load_test.py)",
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("worker", "rank0"))
    ap.add_argument("--merge", nargs=2, metavar=("WORKER_JSON", "RANK0_JSON"))
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_DIR") or "")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=3, help="worker: rounds of the four changes")
    ap.add_argument("--rank0-reps", type=int, default=1, help="rank0: rounds of the four changes through load_models_gpu")
    ap.add_argument("--step-reps", type=int, default=3, help="worker: interleaved forward rounds")
    ap.add_argument("--mmap-blocks", type=int, default=4)
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--dry-run", action="store_true", help="tiny H3 on the CPU")
    a = ap.parse_args(argv)
    if a.merge:
        return merge(a.merge, a.out)
    setup_comfyui(a.comfyui, a.dry_run)
    out = {"role": a.role, "command": " ".join(sys.argv),
           "machine": {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
                       "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count()},
           "lora": {"rank": RANK, "factor_dtype": "bfloat16", "linears": list(LINEARS)}}

    def save():
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2, sort_keys=True)
            f.write("\n")

    (role_worker if a.role == "worker" else role_rank0)(a, out, save)
    save()


if __name__ == "__main__":
    main()
