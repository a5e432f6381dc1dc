"""MiniMax H3 sequence parallelism, end to end: the project's main job.

Generates (or loads) an H3 checkpoint, applies an optional LoRA, samples K flow-matching Euler
steps in H3's timestep domain once in this process and once sharded over N ranks through
comfy.parallel, and prints a parity + timing table (also written as JSON).

  python scripts/h3_sequence_parallel.py                        # small random H3, 2 CPU ranks (gloo)
  python scripts/h3_sequence_parallel.py --ranks 4 --steps 8
  python scripts/h3_sequence_parallel.py --device cuda --ranks 2 --checkpoint /models/h3.safetensors
"""

import argparse
import json
import os
import platform
import sys
import time

import torch
from safetensors.torch import save_file
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from comfy import model_patcher_snapshot as snapshots  # noqa: E402
from comfy.ldm.minimax_h3.checkpoint import LoaderSpec  # noqa: E402
from comfy.ldm.minimax_h3.conditioning import time_shift_sigma  # noqa: E402
from comfy.ldm.minimax_h3.model import SEQUENCE_PARALLEL_OPTION, MiniMaxH3Model  # noqa: E402
from comfy.ldm.minimax_h3.sequence_parallel import SequenceParallel  # noqa: E402
from comfy.ldm.minimax_h3.synthetic import SyntheticPatcher, random_state_dict, step_inputs  # noqa: E402
from comfy.ldm.minimax_h3.ulysses import DEFAULT_CHUNKS  # noqa: E402

SMALL_CONFIG = {"hidden_size": 256, "num_layers": 6, "token_refiner_num_layers": 1, "num_attention_heads": 8,
                "attention_head_dim": 32, "ffn_hidden_size": 512, "text_dim": 192, "timestep_input_dim": 64,
                "time_embed_hidden_size": 256, "time_embed_dim": 128, "rope_inv_freq_len": 4}
TOLERANCE = 1e-4  # max |sharded - single| / max |single| after all steps (fp32)


def make_checkpoint(path, seed):
    model = MiniMaxH3Model(**SMALL_CONFIG, dtype=torch.float32)
    sd = random_state_dict(model, seed=seed)
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in sd.items()}, path)
    return path


def sigmas(steps, shift):
    """Shifted flow-matching schedule from 1 to 0 (the video stream's)."""
    s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return [float(time_shift_sigma(x, 1.0, shift)) for x in s]


def sample(model, x, context, payload, opts, schedule, desc):
    """Euler: x <- x + (sigma_next - sigma) * v, with v the model's output in ComfyUI's FLOW convention."""
    x = [t.clone() for t in x]
    per_step = []
    for sigma, nxt in tqdm(list(zip(schedule, schedule[1:])), desc=desc, unit="step", leave=False):
        t0 = time.perf_counter()
        with torch.no_grad():
            v = model(x, torch.tensor([sigma * 1000.0], device=x[0].device), context, dict(opts), minimax_payload=payload)
        x = [a + (nxt - sigma) * b for a, b in zip(x, v)]
        if x[0].is_cuda:
            torch.cuda.synchronize()
        per_step.append(time.perf_counter() - t0)
    return x, per_step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--checkpoint", help="an H3 safetensors checkpoint; default: a small random one in --out-dir")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--lora-rank", type=int, default=8, help="random LoRA on every block linear; 0 for none")
    ap.add_argument("--kind", default="keyframes", help="t2va, tags, keyframes, ref_image, ..., refs_all")
    ap.add_argument("--frames", type=int, default=5)
    ap.add_argument("--height", type=int, default=16)
    ap.add_argument("--width", type=int, default=24)
    ap.add_argument("--text-len", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunks", type=int, default=DEFAULT_CHUNKS, help="all-to-all pipeline depth (head chunks per rank)")
    ap.add_argument("--out-dir", default="out")
    args = ap.parse_args()

    os.makedirs(args.out_dir, exist_ok=True)
    path = args.checkpoint or os.path.join(args.out_dir, "h3_small_random.safetensors")
    if args.checkpoint is None and not os.path.exists(path):
        make_checkpoint(path, args.seed)
    devices = [f"cuda:{i}" for i in range(args.ranks)] if args.device == "cuda" else ["cpu"] * args.ranks
    spec = LoaderSpec.for_file(path, dtype=args.dtype)
    cfg = spec.config
    dev = devices[0]

    x, _, context, payload = step_inputs(cfg, args.kind, seed=args.seed, text_len=args.text_len, frames=args.frames,
                                         height=args.height, width=args.width, audio_t=2 * args.frames + 1)
    x = [t.to(dev) for t in x]
    context = context.to(dev, getattr(torch, args.dtype))
    payload = {k: ([t.to(dev) for t in v] if k.startswith("cond_") else v) for k, v in payload.items()}
    schedule = sigmas(args.steps, shift=cfg.get("sigma_shift_video", 12.0))

    reference = spec.load(device=dev)
    patcher = SyntheticPatcher(reference)
    if args.lora_rank:
        patcher.add_lora(reference, rank=args.lora_rank, seed=args.seed + 1)
    snap = snapshots.PatchSnapshot.capture(patcher)
    snapshots.apply(snap, reference, key_prefix="diffusion_model.", arithmetic="builtin")
    tokens = reference.plan(x[0], tuple(x[0].shape[2:]), x[1], torch.tensor([500.0]), context, {}, payload).seq_len

    single, single_steps = sample(reference, x, context, payload, {}, schedule, "1 process")
    del reference

    rank0 = spec.load(device=dev)
    sp = SequenceParallel(devices, spec, apply_on_rank0=True, log_dir=os.path.join(args.out_dir, "logs"), chunks=args.chunks)
    try:
        t0 = time.perf_counter()
        sp.ensure_started(rank0)
        startup = time.perf_counter() - t0
        t0 = time.perf_counter()
        sp.sync(snap)
        sync_s = time.perf_counter() - t0
        sharded, sharded_steps = sample(rank0, x, context, payload, {SEQUENCE_PARALLEL_OPTION: sp}, schedule,
                                        f"{args.ranks} ranks")
    finally:
        sp.close()

    rel = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(sharded, single)]
    ok = max(rel) <= TOLERANCE
    result = {"ranks": args.ranks, "chunks": args.chunks, "device": args.device, "backend": "nccl" if args.device == "cuda" else "gloo",
              "steps": args.steps, "tokens": tokens, "dtype": args.dtype, "kind": args.kind, "config": cfg,
              "lora_keys": snap.key_count, "patch_version": list(snap.version),
              "single_step_s": sorted(single_steps)[len(single_steps) // 2],
              "sharded_step_s": sorted(sharded_steps)[len(sharded_steps) // 2],
              "startup_s": startup, "snapshot_sync_s": sync_s,
              "rel_diff_video": rel[0], "rel_diff_audio": rel[1], "tolerance": TOLERANCE, "parity": ok,
              "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}}
    with open(os.path.join(args.out_dir, "h3_sequence_parallel.json"), "w") as f:
        json.dump(result, f, indent=1)

    print(f"MiniMax H3 sequence parallel: {tokens} tokens, {args.steps} Euler steps, {args.kind}, {args.dtype}, "
          f"LoRA on {snap.key_count} weights, {args.ranks} ranks on {args.device} ({result['backend']})")
    print("| run              | start-up s | snapshot sync s | median step s |")
    print("|------------------|-----------:|----------------:|--------------:|")
    print(f"| single process   |          - |               - | {result['single_step_s']:13.4f} |")
    print(f"| {args.ranks} ranks          | {startup:10.2f} | {sync_s:15.3f} | {result['sharded_step_s']:13.4f} |")
    print(f"parity after {args.steps} steps: video {rel[0]:.2e}, audio {rel[1]:.2e} (max |diff| / max |single|; "
          f"tolerance {TOLERANCE:.0e}) -> {'PASS' if ok else 'FAIL'}")
    print(f"written: {os.path.join(args.out_dir, 'h3_sequence_parallel.json')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
