"""MiniMax H3 sequence parallelism end to end, as a ComfyUI workflow run headless: the project's main job.

    UNETLoader -> [MiniMax H3 Sequence Parallel] -> LoraLoaderModelOnly -> KSampler

on a small generated H3 checkpoint (or --checkpoint), with ComfyUI's own nodes, loader, ModelPatcher
and sampler: once without the node and once with it on N ranks, for two seeds at --cfg (> 1) and
one at cfg 1 (H3's released checkpoints are CFG-distilled: cfg 1 is their usual run). Every sharded
run reuses the same workers; a run with the same LoRA sends nothing. Prints a parity + timing table;
the JSON (--out-dir/h3_sequence_parallel.json) is written only once the verdict is known.
Runs in a patched ComfyUI tree (--comfyui; scripts/run_main.sh builds one and passes it).

  scripts/run_main.sh                                     # small random H3, 2 CPU ranks
  scripts/run_main.sh --ranks 3 --weight-dtype fp8_e4m3fn
  scripts/run_main.sh --device cuda --ranks 2 --checkpoint /models/h3.safetensors --lora-rank 0
  scripts/run_main.sh --device cuda --share-gpu           # 2 ranks on one GPU: the data path, not a speed-up
"""

import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = "h3_sequence_parallel.json"

SMALL_CONFIG = {"hidden_size": 256, "num_layers": 6, "token_refiner_num_layers": 1, "num_attention_heads": 8,
                "attention_head_dim": 32, "ffn_hidden_size": 512, "text_dim": 192, "timestep_input_dim": 64,
                "time_embed_hidden_size": 256, "time_embed_dim": 128, "rope_inv_freq_len": 4}
# max |sharded - native| / max |native| of the final latent: fp32 compute differs by float reassociation
# only; bf16 / fp16 compute (a GPU) by GEMMs blocked on other row counts
TOLERANCE = {"float32": 1e-4, "other": 3e-2}


def setup_comfyui(tree, a):
    """Import ComfyUI from the patched tree (run_main.sh also puts it first on PYTHONPATH, for the workers)
    and start its devices as main.py does (DynamicVRAM where ComfyUI enables it), with the memory flags given."""
    if not tree or not os.path.isfile(os.path.join(tree, "comfy", "model_patcher.py")):
        sys.exit("--comfyui must name a patched ComfyUI tree; scripts/run_main.sh builds one")
    tree = os.path.abspath(tree)
    sys.path[:0] = [tree, os.path.join(tree, "tests-unit")]  # tests-unit: h3_files, the checkpoint writer
    from comfy.cli_args import args, get_console_log_level
    args.cpu = a.device == "cpu"
    args.reserve_vram = a.reserve_vram
    args.disable_dynamic_vram = a.disable_dynamic_vram
    start_dynamic_vram(args, get_console_log_level(args.verbose))


def start_dynamic_vram(args, level):
    """DynamicVRAM as ComfyUI's main.py starts it (this script runs ComfyUI without main.py)."""
    from comfy.cli_args import enables_dynamic_vram
    if not enables_dynamic_vram():
        return
    import comfy_aimdo.control
    headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024 ** 3)
    comfy_aimdo.control.init(simple_vram_headroom=headroom, nvml_pressure=not args.disable_nvml_pressure)
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher
    if not (mm.is_nvidia() or (mm.is_amd() and mm.rocm_version >= (7, 14))) or mm.torch_version_numeric < (2, 8):
        return
    if comfy_aimdo.control.init_devices((d.index, int(args.vram_headroom * 1024 ** 3)) for d in mm.get_all_torch_devices()):
        getattr(comfy_aimdo.control, f"set_log_{level.lower()}", comfy_aimdo.control.set_log_info)()
        comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
        comfy.memory_management.aimdo_enabled = True


def check_gpus(ranks):
    """Before anything starts: one GPU per rank (one for --share-gpu)."""
    import torch
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < ranks:
        names = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(found)) or "none"
        sys.exit(f"--device cuda needs {ranks} GPU(s); this python ({sys.executable}, torch "
                 f"{torch.__version__}) sees {found}: {names}. Use fewer --ranks or another --python.")


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
        lora = os.path.join(models, "loras", f"h3_small_lora_r{lora_rank}.safetensors")
        save_file(lora_state_dict(SMALL_CONFIG, rank=lora_rank, seed=seed + 1, scale=0.05), lora)
    del torch
    return checkpoint, lora


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line, exit 2 (argparse would print its whole usage first)."""
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def parse_args(argv=None):
    """Every argument checked before anything is set up: a bad one is a one-line error (exit 2)."""
    ap = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfyui", help="the patched ComfyUI tree to run in (scripts/run_main.sh passes it)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks to shard over, 2 or more (default 2)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--share-gpu", action="store_true", help="with --device cuda: every rank on cuda:0 (a test of the data path, not a speed-up)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cfg", type=float, default=3.0, help="the cfg > 1 workflow's cfg (a cfg 1 workflow runs beside it)")
    ap.add_argument("--checkpoint", help="an H3 safetensors checkpoint; default: a small random one under --out-dir")
    ap.add_argument("--weight-dtype", default="default", choices=("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"),
                    help="UNETLoader's weight_dtype")
    ap.add_argument("--fp8-exchange", action="store_true", help="the node's fp8_exchange (lossy: parity is then reported, not required)")
    ap.add_argument("--lora-rank", type=int, default=8, help="random LoRA on every block linear; 0 for none")
    ap.add_argument("--lora-strength", type=float, default=0.8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--length", type=int, default=22, help="frames (the latent grid snaps to 17k+5)")
    ap.add_argument("--text-len", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="out")
    ap.add_argument("--cases", type=int, default=3, help="workflows to run: cfg 1, then cfg --cfg with two seeds (default all 3)")
    ap.add_argument("--reserve-vram", type=float, help="ComfyUI's --reserve-vram (GB), for rank 0 and the workers")
    ap.add_argument("--disable-dynamic-vram", action="store_true", help="ComfyUI's --disable-dynamic-vram, for every rank")
    ap.add_argument("--check-args", action="store_true", help=argparse.SUPPRESS)  # run_main.sh: validate, before set-up
    a = ap.parse_args(argv)
    problems = [f"--{name} must be {want}" for name, ok, want in (
        ("ranks", a.ranks >= 2, "2 or more (one rank is the workflow without the node)"),
        ("steps", a.steps >= 1, "1 or more"), ("cfg", a.cfg > 0, "positive"),
        ("lora-rank", a.lora_rank >= 0, "0 (none) or more"),
        ("width", a.width >= 16, "16 or more"), ("height", a.height >= 16, "16 or more"),
        ("length", a.length >= 1, "1 or more"), ("text-len", a.text_len >= 1, "1 or more"),
        ("cases", 1 <= a.cases <= 3, "1, 2 or 3")) if not ok]
    if a.checkpoint is not None and not os.path.isfile(a.checkpoint):
        problems.append(f"--checkpoint {a.checkpoint}: no such file")
    if a.checkpoint is not None and a.lora_rank:
        problems.append("--lora-rank with --checkpoint needs a LoRA made for that checkpoint: pass --lora-rank 0")
    if a.checkpoint is None and a.ranks > SMALL_CONFIG["num_attention_heads"]:
        problems.append(f"--ranks {a.ranks}: the default model has {SMALL_CONFIG['num_attention_heads']} attention heads, so at most that many ranks")
    if a.share_gpu and a.device != "cuda":
        problems.append("--share-gpu needs --device cuda")
    if problems:
        ap.error("; ".join(problems))
    return a


def main():
    a = parse_args()
    if a.check_args:
        return 0
    out = os.path.abspath(a.out_dir)
    result_path = os.path.join(out, RESULT)
    if os.path.exists(result_path):
        os.remove(result_path)  # a failed run must not leave the previous run's verdict behind
    if a.device == "cuda":
        check_gpus(1 if a.share_gpu else a.ranks)

    setup_comfyui(a.comfyui, a)
    import torch

    import comfy.ldm.common_dit
    import comfy.model_management
    import comfy.patcher_extension
    import comfy_extras.nodes_minimax_h3_parallel as sp_node
    import folder_paths
    import nodes
    from comfy.ldm.minimax.model import PackedLayout
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    models = os.path.join(out, "models")
    checkpoint, lora = make_files(models, a.checkpoint and os.path.abspath(a.checkpoint), a.lora_rank, a.seed)
    folder_paths.add_model_folder_path("diffusion_models", os.path.dirname(checkpoint), is_default=True)
    folder_paths.add_model_folder_path("loras", os.path.join(models, "loras"), is_default=True)
    folder_paths.set_temp_directory(os.path.join(out, "temp"))

    base = nodes.UNETLoader().load_unet(os.path.basename(checkpoint), a.weight_dtype)[0]
    diffusion = base.model.diffusion_model
    heads = diffusion.blocks[0].attn.heads
    if a.ranks > heads:
        print(f"h3_sequence_parallel.py: error: --ranks {a.ranks}: {checkpoint} has {heads} attention heads, so at most that many ranks",
              file=sys.stderr)
        return 2
    if a.device == "cpu" or a.share_gpu:
        # the node shards over the devices ComfyUI reports: here as many CPU (or shared-GPU) ranks as asked
        first = comfy.model_management.get_torch_device()
        comfy.model_management.get_all_torch_devices = lambda exclude_current=False: [first] * a.ranks
    latent = EmptyMiniMaxH3LatentAV.execute(a.width, a.height, a.length).result[0]
    g = torch.Generator().manual_seed(a.seed)
    text_dim = diffusion.condition_proj.in_features
    positive = [[torch.randn(1, a.text_len, text_dim, generator=g), {}]]
    negative = [[torch.randn(1, a.text_len // 2, text_dim, generator=g), {}]]

    def workflow(model, seed, cfg):
        if lora is not None:
            model = nodes.LoraLoaderModelOnly().load_lora_model_only(model, os.path.basename(lora), a.lora_strength)[0]
        t0 = time.perf_counter()
        samples = nodes.KSampler().sample(model, seed, a.steps, cfg, "euler", "simple", positive, negative, latent)[0]["samples"]
        if a.device == "cuda":
            torch.cuda.synchronize()
        return (samples.unbind() if samples.is_nested else [samples]), time.perf_counter() - t0

    def rel(x, y):
        return max(float((u - v).abs().max() / v.abs().max()) for u, v in zip(x, y))

    cases = [(a.seed + 1, 1.0), (a.seed + 1, a.cfg), (a.seed + 2, a.cfg)][:a.cases]  # (seed, cfg)
    native = [workflow(base, s, cfg) for s, cfg in cases]
    # on a GPU the same workflow twice need not agree bit for bit: what sharding adds is read against that
    floor = rel(workflow(base, *cases[0])[0], native[0][0]) if a.device == "cuda" else 0.0
    parallel = sp_node.MiniMaxH3SequenceParallel.execute(base, a.ranks, a.fp8_exchange).result[0]
    sp = parallel.get_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, sp_node.KEY)[0]  # the runner the node attached
    runs = []
    try:
        for s, cfg in cases:
            samples, seconds = workflow(parallel, s, cfg)
            runs.append({"seed": s, "cfg": cfg, "seconds": seconds, "samples": samples,
                         "worker_pids": dict(sorted(sp.group.worker_pids().items())),
                         "patch_sync": sp.last_sent, "sharded_steps": sp.steps_run})
        startup = dict(sp.group.startup_seconds)
    finally:
        comfy.model_management.unload_all_models()  # ComfyUI's unload: the workers unload their model and stay
    kept = bool(runs) and sp.group.state == "ready" and dict(sorted(sp.group.worker_pids().items())) == runs[-1]["worker_pids"]
    group, devices = sp.group, [str(d) for d in sp.devices]
    del parallel, sp  # ComfyUI frees the model (its cache drops it): the workers end on a thread of their own
    end = time.monotonic() + 60
    while group.state != "closed" and time.monotonic() < end:
        time.sleep(0.05)
    closed = group.state == "closed"
    group.close()  # nothing left running whatever the verdict

    table = []
    for (ref, ref_s), run in zip(native, runs):
        table.append({"seed": run["seed"], "cfg": run["cfg"], "native_s": ref_s, "sharded_s": run["seconds"],
                      "rel_diff": rel(run["samples"], ref), "worker_pids": run["worker_pids"], "patch_sync": run["patch_sync"]})
    same_workers = all(r["worker_pids"] == table[0]["worker_pids"] for r in table)
    compute = str(base.model.manual_cast_dtype or base.model_dtype()).removeprefix("torch.")
    tolerance = TOLERANCE["float32" if compute == "float32" else "other"]
    ok = (a.fp8_exchange or all(r["rel_diff"] <= max(tolerance, 2 * floor) for r in table)) and same_workers and kept and closed
    tokens = sequence_length(PackedLayout, comfy.ldm.common_dit.pad_to_patch_size, diffusion, latent, positive)
    result = {"ranks": a.ranks, "device": a.device, "devices": devices, "transport": "shared host memory", "steps": a.steps,
              "cfgs": sorted({cfg for _, cfg in cases}), "tokens": tokens, "rank0_pid": os.getpid(), "weight_dtype": a.weight_dtype,
              "checkpoint": checkpoint, "model_dtype": str(base.model_dtype()), "lora": lora, "lora_strength": a.lora_strength,
              "fp8_exchange": a.fp8_exchange, "runs": table, "startup_s": startup, "sharded_model_calls": runs[-1]["sharded_steps"],
              "workers_kept_on_unload": kept, "workers_closed_when_freed": closed, "compute_dtype": compute, "tolerance": tolerance,
              "native_run_to_run": floor, "parity_rule": "every run's rel_diff <= max(tolerance, 2 x native_run_to_run)", "parity": ok,
              "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}}

    print(f"MiniMax H3 sequence parallel, ComfyUI workflow: {tokens} tokens, KSampler {a.steps} steps euler, "
          f"weights {result['model_dtype']} ({a.weight_dtype}), LoRA {'none' if lora is None else a.lora_strength}, "
          f"{a.ranks} ranks on {', '.join(devices)}")
    print(f"| seed | cfg | native s | sharded s | max rel diff | PIDs by rank (rank 0 is this process, pid {os.getpid()}; the others are its workers) | patch sync |")
    print("|-----:|----:|---------:|----------:|-------------:|-------------|------------|")
    for r in table:
        sync = "none (same version)" if r["patch_sync"] is None else f"{r['patch_sync']['kind']} ({r['patch_sync'].get('keys', r['patch_sync'].get('changed'))} keys)"
        pids = ", ".join(["0: this process"] + [f"{rank}: {pid}" for rank, pid in r["worker_pids"].items()])
        print(f"| {r['seed']} | {r['cfg']:g} | {r['native_s']:.3f} | {r['sharded_s']:.3f} | {r['rel_diff']:.2e} | {pids} | {sync} |")
    print(f"worker start-up {startup.get('total', 0):.2f} s (in the first sharded run); {result['sharded_model_calls']} sharded "
          f"model calls; workers kept on unload: {kept}; closed when the model was freed: {closed}")
    print(f"native run to run (the same workflow twice) {floor:.2e}")
    print(f"parity (tolerance {tolerance:.0e}, {compute} compute{', not required: fp8 exchange' if a.fp8_exchange else ''}), same workers for every run, "
          f"kept on unload, ended when freed -> {'PASS' if ok else 'FAIL'}")
    # written only now that the verdict is known, pass or fail
    os.makedirs(out, exist_ok=True)
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"written: {result_path}")
    return 0 if ok else 1


def sequence_length(packed_layout, pad_to_patch_size, model, latent, positive):
    """Rows of the packed sequence one step of this workflow runs (text + video + audio), from shapes
    only: no text embedding is cast to the model's (maybe fp8) weight dtype to count them."""
    x = latent["samples"]
    video, audio = x.unbind() if x.is_nested else (x, None)
    video = pad_to_patch_size(video, model.patch_size)
    audio_t = 0 if audio is None else audio.shape[-1]
    return packed_layout(positive[0][0].shape[1], video.shape[2], video.shape[3], video.shape[4], audio_t).seq_len


if __name__ == "__main__":
    sys.exit(main())
