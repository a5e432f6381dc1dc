"""MiniMax H3 sequence parallelism end to end, as a ComfyUI workflow run headless: the project's main job.

    UNETLoader -> [MiniMax H3 Sequence Parallel] -> LoraLoaderModelOnly -> KSampler (cfg > 1)

on a small generated H3 checkpoint (or --checkpoint), with ComfyUI's own nodes, loader, ModelPatcher
and sampler: once without the node and once with it on N ranks, for two seeds (the second reuses
the same workers and sends nothing). Prints a parity + timing table and writes it as JSON. Needs a
ComfyUI tree of the pinned base in COMFYUI_DIR (scripts/run_main.sh provides one).

  python scripts/h3_sequence_parallel.py                         # small random H3, 2 CPU ranks (gloo)
  python scripts/h3_sequence_parallel.py --ranks 3 --steps 8
  python scripts/h3_sequence_parallel.py --device cuda --ranks 2 --checkpoint /models/h3.safetensors
"""

import argparse
import json
import os
import platform
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.join(ROOT, "scripts", "comfyui_site")

SMALL_CONFIG = {"hidden_size": 256, "num_layers": 6, "token_refiner_num_layers": 1, "num_attention_heads": 8,
                "attention_head_dim": 32, "ffn_hidden_size": 512, "text_dim": 192, "timestep_input_dim": 64,
                "time_embed_hidden_size": 256, "time_embed_dim": 128, "rope_inv_freq_len": 4}
TOLERANCE = 1e-4  # max |sharded - native| / max |native| of the final latent (fp32 compute)


def setup_comfyui(device):
    """This repository over the ComfyUI tree in COMFYUI_DIR, as a patched tree; workers inherit it."""
    comfyui = os.environ.get("COMFYUI_DIR")
    if not comfyui or not os.path.isfile(os.path.join(comfyui, "comfy", "model_patcher.py")):
        sys.exit("COMFYUI_DIR must point at a ComfyUI tree of the pinned base; scripts/run_main.sh sets one up")
    sys.path[:0] = [SITE, ROOT]
    sys.path.append(os.path.abspath(comfyui))
    runpy.run_path(os.path.join(SITE, "sitecustomize.py"))
    from comfy.cli_args import args
    args.cpu = device == "cpu"


def make_files(models, checkpoint, lora_rank, seed):
    import torch
    from safetensors.torch import save_file

    from h3_files import lora_state_dict, write_h3_file
    os.makedirs(os.path.join(models, "diffusion_models"), exist_ok=True)
    os.makedirs(os.path.join(models, "loras"), exist_ok=True)
    if checkpoint is None:
        checkpoint = os.path.join(models, "diffusion_models", "h3_small_random.safetensors")
        if not os.path.exists(checkpoint):
            write_h3_file(checkpoint, SMALL_CONFIG, seed=seed)
    lora = None
    if lora_rank:
        config = SMALL_CONFIG if checkpoint.endswith("h3_small_random.safetensors") else None
        if config is None:
            sys.exit("--lora-rank with --checkpoint needs a LoRA made for that checkpoint; pass --lora-rank 0")
        lora = os.path.join(models, "loras", f"h3_small_lora_r{lora_rank}.safetensors")
        save_file(lora_state_dict(config, rank=lora_rank, seed=seed + 1, scale=0.05), lora)
    del torch
    return checkpoint, lora


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cfg", type=float, default=3.0)
    ap.add_argument("--checkpoint", help="an H3 safetensors checkpoint; default: a small random one under --out-dir")
    ap.add_argument("--weight-dtype", default="default", choices=("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"),
                    help="UNETLoader's weight_dtype")
    ap.add_argument("--lora-rank", type=int, default=8, help="random LoRA on every block linear; 0 for none")
    ap.add_argument("--lora-strength", type=float, default=0.8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--length", type=int, default=22, help="frames (the latent grid snaps to 17k+5)")
    ap.add_argument("--text-len", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="out")
    a = ap.parse_args()

    setup_comfyui(a.device)
    import torch

    import comfy.model_management
    import folder_paths
    import nodes
    from comfy.ldm.minimax_h3.model import SEQUENCE_PARALLEL_OPTION
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV
    from comfy_extras.nodes_minimax_h3_parallel import MiniMaxH3SequenceParallel

    out = os.path.abspath(a.out_dir)
    models = os.path.join(out, "models")
    checkpoint, lora = make_files(models, a.checkpoint and os.path.abspath(a.checkpoint), a.lora_rank, a.seed)
    folder_paths.add_model_folder_path("diffusion_models", os.path.dirname(checkpoint), is_default=True)
    folder_paths.add_model_folder_path("loras", os.path.join(models, "loras"), is_default=True)
    folder_paths.set_temp_directory(os.path.join(out, "temp"))

    base = nodes.UNETLoader().load_unet(os.path.basename(checkpoint), a.weight_dtype)[0]
    diffusion = base.model.diffusion_model
    latent = EmptyMiniMaxH3LatentAV.execute(a.width, a.height, a.length).result[0]
    g = torch.Generator().manual_seed(a.seed)
    text_dim = diffusion.text_dim
    positive = [[torch.randn(1, a.text_len, text_dim, generator=g), {}]]
    negative = [[torch.randn(1, a.text_len // 2, text_dim, generator=g), {}]]
    devices = [f"cuda:{i}" for i in range(a.ranks)] if a.device == "cuda" else ["cpu"] * a.ranks

    def workflow(model, seed):
        if lora is not None:
            model = nodes.LoraLoaderModelOnly().load_lora_model_only(model, os.path.basename(lora), a.lora_strength)[0]
        t0 = time.perf_counter()
        samples = nodes.KSampler().sample(model, seed, a.steps, a.cfg, "euler", "simple", positive, negative, latent)[0]["samples"]
        if a.device == "cuda":
            torch.cuda.synchronize()
        return (samples.unbind() if samples.is_nested else [samples]), time.perf_counter() - t0

    def rel(x, y):
        return max(float((u - v).abs().max() / v.abs().max()) for u, v in zip(x, y))

    seeds = [a.seed + 1, a.seed + 2]
    native = [workflow(base, s) for s in seeds]
    parallel = MiniMaxH3SequenceParallel.execute(base, ",".join(devices)).result[0]
    sp = parallel.model_options["transformer_options"][SEQUENCE_PARALLEL_OPTION]
    runs = []
    try:
        for s in seeds:
            samples, seconds = workflow(parallel, s)
            runs.append({"seed": s, "seconds": seconds, "samples": samples, "worker_pids": sorted(sp.group.worker_pids().values()),
                         "patch_sync": sp.last_sent, "sharded_steps": sp.steps_run})
        startup = dict(sp.group.startup_seconds)
    finally:
        comfy.model_management.unload_all_models()  # ends the workers, as ComfyUI does when it frees the model
    closed = sp.group.state == "closed"

    table = []
    for (ref, ref_s), run in zip(native, runs):
        table.append({"seed": run["seed"], "native_s": ref_s, "sharded_s": run["seconds"],
                      "rel_diff": rel(run["samples"], ref), "worker_pids": run["worker_pids"], "patch_sync": run["patch_sync"]})
    ok = all(r["rel_diff"] <= TOLERANCE for r in table) and table[0]["worker_pids"] == table[1]["worker_pids"] and closed
    tokens = diffusion.plan(_plan_inputs(diffusion, latent, positive)).seq_len
    result = {"ranks": a.ranks, "device": a.device, "backend": "nccl" if a.device == "cuda" else "gloo", "steps": a.steps,
              "cfg": a.cfg, "tokens": tokens, "weight_dtype": a.weight_dtype, "checkpoint": checkpoint,
              "model_dtype": str(base.model_dtype()), "lora": lora, "lora_strength": a.lora_strength, "runs": table,
              "startup_s": startup, "sharded_model_calls": runs[-1]["sharded_steps"], "workers_closed_on_unload": closed,
              "tolerance": TOLERANCE, "parity": ok,
              "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}}
    with open(os.path.join(out, "h3_sequence_parallel.json"), "w") as f:
        json.dump(result, f, indent=1)

    print(f"MiniMax H3 sequence parallel, ComfyUI workflow: {tokens} tokens, KSampler {a.steps} steps euler cfg {a.cfg}, "
          f"weights {result['model_dtype']}, LoRA {'none' if lora is None else a.lora_strength}, {a.ranks} ranks on "
          f"{a.device} ({result['backend']})")
    print("| seed | native s | sharded s | max rel diff | worker PIDs | patch sync |")
    print("|-----:|---------:|----------:|-------------:|-------------|------------|")
    for r in table:
        sync = "none (same version)" if r["patch_sync"] is None else f"{r['patch_sync']['kind']} ({r['patch_sync'].get('keys', r['patch_sync'].get('changed'))} keys)"
        print(f"| {r['seed']} | {r['native_s']:.3f} | {r['sharded_s']:.3f} | {r['rel_diff']:.2e} | {r['worker_pids']} | {sync} |")
    print(f"worker start-up {startup.get('total', 0):.2f} s (in the first sharded run); {result['sharded_model_calls']} sharded "
          f"model calls; workers closed on unload: {closed}")
    print(f"parity (tolerance {TOLERANCE:.0e}), same workers for both seeds, clean unload -> {'PASS' if ok else 'FAIL'}")
    print(f"written: {os.path.join(out, 'h3_sequence_parallel.json')}")
    return 0 if ok else 1


def _plan_inputs(model, latent, positive):
    """StepInputs of one step of this workflow (to report the sequence length)."""
    import torch

    import comfy.nested_tensor  # noqa: F401
    from comfy.ldm.minimax_h3.step_io import StepInputs
    x = latent["samples"]
    video, audio = x.unbind() if x.is_nested else (x, None)
    context = model.preprocess_text_embeds(positive[0][0].to(model.condition_proj.weight.dtype))
    return StepInputs(video, audio, torch.tensor([500.0]), context, {}, {})


if __name__ == "__main__":
    sys.exit(main())
