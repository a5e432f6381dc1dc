"""H3's video VAE decode over N ranks sharing ONE GPU, through the shipped node (MiniMax H3 Sequence Parallel
VAE) and ComfyUI's own VAELoader, against ComfyUI's decode in one process. The VAE is real size (upstream's
MiniMaxH3VideoVAE, 2.4e9 decoder parameters) with seeded random weights; the sequence-parallel model whose
workers decode is a tiny H3 (its steps are not what is measured). The ranks share the GPU's compute, so the
sharded decode here is no speed-up; what this measures is (1) sharded vs one-process output, (2) every rank's
peak GPU memory (nvidia-smi, per process), (3) the decode's parts on one GPU: the decoder calls and the rest
(blending, the copy to host), from which an EMULATED decode time on N separate GPUs is derived.

  cd <patched tree> && python /path/bench/h3_vae_shared_gpu.py --out vae.json
"""

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time

import torch

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests-unit")]  # the tree (cwd) and its test helpers
from safetensors.torch import save_file  # noqa: E402

import comfy.model_management  # noqa: E402
import comfy.patcher_extension  # noqa: E402
import folder_paths  # noqa: E402
from h3_files import TINY_CONFIG, write_h3_file  # noqa: E402

CASES = {"832x480x121": (37, 30, 52), "1344x768x243": (72, 48, 84)}  # latent frames, height, width
LINKS_GB_S = {"PCIe 4 x16": 25.0, "PCIe 3 x8": 6.5}


def write_vae(path, seed=0):
    """Upstream's VAE at its real size, seeded normal weights (std 0.02; norms 1), fp16."""
    from comfy.ldm.minimax.vae import LATENTS_MEAN, LATENTS_STD, MiniMaxH3VideoVAE
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in MiniMaxH3VideoVAE().state_dict().items()}
    g = torch.Generator("cuda").manual_seed(seed)
    sd = {}
    for k, shape in shapes.items():
        if k.startswith("latents_"):
            sd[k] = torch.tensor(LATENTS_MEAN if k == "latents_mean" else LATENTS_STD)
        elif "norm" in k and k.endswith("weight"):
            sd[k] = torch.ones(shape, dtype=torch.float16)
        else:
            sd[k] = (torch.randn(shape, generator=g, device="cuda") * 0.02).half().cpu()
    save_file(sd, path)


class PeakMemory:
    """Each process's peak GPU memory (MiB) as nvidia-smi reports it, polled every 0.1 s."""

    def __init__(self):
        self.peak, self._stop = {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout
            for line in out.strip().splitlines():
                try:
                    pid, mib = (int(x) for x in line.split(","))
                except ValueError:  # "[N/A]" where the driver hides processes (a container)
                    continue
                self.peak[pid] = max(self.peak.get(pid, 0), mib)
            time.sleep(0.1)

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.peak


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dir", default="/dev/shm/h3_vae_bench")
    a = ap.parse_args()
    import nodes
    from comfy.ldm.minimax import vae_parallel
    from comfy_extras.nodes_minimax_h3_parallel import KEY, MiniMaxH3SequenceParallel, MiniMaxH3SequenceParallelVAE
    os.makedirs(os.path.join(a.dir, "vae"), exist_ok=True)
    os.makedirs(os.path.join(a.dir, "diffusion_models"), exist_ok=True)
    for kind in ("vae", "diffusion_models"):
        folder_paths.folder_names_and_paths[kind] = ([os.path.join(a.dir, kind)], folder_paths.supported_pt_extensions)
    folder_paths.filename_list_cache = {}
    t0 = time.perf_counter()
    write_vae(os.path.join(a.dir, "vae", "h3_vae.safetensors"))
    write_h3_file(os.path.join(a.dir, "diffusion_models", "h3_tiny.safetensors"), TINY_CONFIG, seed=2, dtype=torch.bfloat16)
    result = {"what": __doc__.split("\n\n")[0], "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                       text=True).stdout.strip(),
              "machine": platform.node(), "commit": os.environ.get("H3SP_COMMIT"),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "write_s": time.perf_counter() - t0, "runs": []}
    gpu = comfy.model_management.get_torch_device()
    with torch.inference_mode():  # as ComfyUI runs its nodes
        vae = nodes.VAELoader().load_vae("h3_vae.safetensors")[0]
        model = vae.first_stage_model
        for case in a.cases.split(","):
            z = torch.randn(1, 24, *CASES[case], generator=torch.Generator().manual_seed(4))
            peak = PeakMemory()
            torch.cuda.reset_peak_memory_stats()
            vae.decode(z[:, :, :7])  # warm-up
            want, one_s = timed(lambda: vae.decode(z))
            calls = vae_parallel.tile_inputs(model, z.to(gpu, vae.vae_dtype))
            shapes = [vae_parallel._tile_output(model, t, "meta") for t in calls]
            zeros = {tuple(s.shape): torch.zeros(s.shape, dtype=s.dtype, device=gpu) for s in shapes}
            with vae_parallel._decoder(model, lambda t: zeros[tuple(vae_parallel._tile_output(model, t, "meta").shape)]):
                _, rest_s = timed(lambda: vae.decode(z))  # everything but the decoder calls
            zeros.clear()
            one_peak = peak.stop().get(os.getpid())
            run = {"case": case, "latent": list(z.shape), "tiles": len(calls), "tile_bytes": sum(s.nbytes for s in shapes),
                   "one_process": {"decode_s": one_s, "decoder_calls_s": one_s - rest_s, "rest_s": rest_s, "peak_mib": one_peak,
                                   "torch_peak_mib": torch.cuda.max_memory_allocated() / 2**20}, "sharded": []}
            result["runs"].append(run)
            save(a.out, result)  # what ran is kept should a later run pass the section's time limit
            for n in [int(r) for r in a.ranks.split(",")]:
                comfy.model_management.get_all_torch_devices = lambda exclude_current=False, n=n: [gpu] * n
                dit = nodes.UNETLoader().load_unet("h3_tiny.safetensors", "default")[0]
                node = MiniMaxH3SequenceParallel.execute(dit, n, False).result[0]
                sp = node.get_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY)[0]
                try:
                    comfy.model_management.load_models_gpu([node])
                    node.pre_run()  # the workers start (as before sampling) and stay ready for the decode
                    sharded = MiniMaxH3SequenceParallelVAE.execute(vae, node).result[0]
                    peak = PeakMemory()
                    sharded.decode(z[:, :, :7])  # warm-up (the workers load the VAE)
                    got, s = timed(lambda: sharded.decode(z))
                    peaks = peak.stop()
                    pids = [os.getpid(), *sp.group.worker_pids().values()]
                    per_gpu = (run["one_process"]["decoder_calls_s"] * math.ceil(len(calls) / n) / len(calls) + rest_s)
                    from_workers = run["tile_bytes"] * (1 - len(range(0, len(calls), n)) / len(calls))
                    run["sharded"].append({
                        "ranks": n, "data_path": sp.group.data_path, "decode_s_shared_gpu": s, "bit_identical": torch.equal(got, want),
                        "max_abs_diff": float((got - want).abs().max()), "peak_mib_per_rank": [peaks.get(pid) for pid in pids],
                        "bytes_to_rank0": from_workers,
                        "emulated_decode_s": {name: per_gpu + from_workers / (gb * 1e9) for name, gb in LINKS_GB_S.items()},
                        "emulated_speedup": {name: one_s / (per_gpu + from_workers / (gb * 1e9)) for name, gb in LINKS_GB_S.items()}})
                    print(json.dumps(run["sharded"][-1]), flush=True)
                    save(a.out, result)
                finally:
                    sp.close()
                    comfy.model_management.unload_all_models()
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save(a.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


def save(path, result):
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
