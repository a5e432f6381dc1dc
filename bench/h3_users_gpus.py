"""Real-size MiniMax H3 on the users' GPUs, emulated on one GPU: the project's main job (ComfyUI's
UNETLoader, the node, KSampler; scripts/h3_sequence_parallel.py) with two ranks that share cuda:0,
each process seeing a smaller card (bench/device_site: torch's allocator capped, and the free and
total memory ComfyUI plans with reporting that card), weights larger than the card, against the same
workflow on one process under the same cap. Sampled every 0.25 s: each process's GPU memory
(nvidia-smi) and resident host memory (/proc), their peaks reported per rank. Both ranks share one
GPU: step times here are a correctness and memory figure, not a speed-up.

  python bench/h3_users_gpus.py --tree TREE --dir /dev/shm --out users_gpus.json
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from h3_sp_emulation import save

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name -> (checkpoint dtype, layers, emulated card GiB or None, extra main-job arguments)
CONFIGS = {
    "fp8_card22": ("float8_e4m3fn", 50, 22, ["--disable-dynamic-vram"]),
    "fp8_uncapped_dynamic_vram": ("float8_e4m3fn", 50, None, []),
    "bf16_25_blocks_card16": ("bfloat16", 25, 16, ["--disable-dynamic-vram"]),
    "bf16_12_blocks_card8": ("bfloat16", 12, 8, ["--disable-dynamic-vram"]),
}


def descendants(pid):
    kids = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            kids.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None


class Sampler:
    def __init__(self, pid):
        self.pid, self.gpu, self.rss, self.stop, self.nvidia_smi = pid, {}, {}, threading.Event(), True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            for p in descendants(self.pid):
                r = rss_mib(p)
                if r is not None:
                    self.rss[p] = max(self.rss.get(p, 0), r)
            if self.nvidia_smi:
                try:
                    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                         capture_output=True, text=True, timeout=10).stdout
                    for line in out.strip().splitlines():
                        p, mib = (int(x) for x in line.split(","))
                        self.gpu[p] = max(self.gpu.get(p, 0), mib)
                except (OSError, ValueError, subprocess.TimeoutExpired):
                    self.nvidia_smi = False
            time.sleep(0.25)


def checkpoint(directory, dtype, layers, tree):
    path = os.path.join(directory, f"h3_{dtype}_{layers}.safetensors")
    if not os.path.exists(path):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "h3_real_checkpoint.py"), "--out", path, "--dtype", dtype,
                              "--layers", str(layers)], cwd=tree, check=True, capture_output=True, text=True)
        print(out.stdout.strip(), flush=True)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", required=True)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    tree = os.path.abspath(a.tree)
    try:  # not through torch: this process holds no CUDA context
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        gpu = None
    result = {"what": __doc__.split("\n\n")[0], "gpu": gpu,
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": {}}
    names = a.configs.split(",")
    for i, name in enumerate(names):
        dtype, layers, card, extra = CONFIGS[name]
        path = checkpoint(a.dir, dtype, layers, tree)
        out_dir = os.path.join(os.path.dirname(os.path.abspath(a.out)), name)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.path.join(ROOT, "bench", "device_site"), os.environ.get("PYTHONPATH", "")]))
        if card:
            env["H3SP_EMULATED_GPU_GIB"] = str(card)
        argv = [sys.executable, os.path.join(ROOT, "scripts", "h3_sequence_parallel.py"), "--comfyui", tree, "--device", "cuda",
                "--share-gpu", "--ranks", "2", "--checkpoint", path, "--lora-rank", "0", "--cases", "1", "--steps", str(a.steps),
                "--width", "832", "--height", "480", "--length", "124", "--text-len", "512", "--out-dir", out_dir, *extra]
        t0 = time.time()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sampler = Sampler(proc.pid)
        log = proc.communicate()[0]
        sampler.stop.set()
        sampler.thread.join()
        run = {"checkpoint": path, "checkpoint_gib": os.path.getsize(path) / 2**30, "layers": layers, "weights": dtype,
               "emulated_card_gib": card, "args": extra, "exit": proc.returncode, "wall_s": time.time() - t0,
               "log_tail": log[-4000:], "nvidia_smi_per_process": sampler.nvidia_smi}
        job = os.path.join(out_dir, "h3_sequence_parallel.json")
        if os.path.exists(job):
            with open(job) as f:
                run["job"] = json.load(f)
            ranks = {0: run["job"]["rank0_pid"], **{int(r): p for r, p in run["job"]["runs"][0]["worker_pids"].items()}}
            run["peak_gpu_mib_by_rank"] = {r: sampler.gpu.get(p) for r, p in ranks.items()}
            run["peak_rss_mib_by_rank"] = {r: sampler.rss.get(p) for r, p in ranks.items()}
        print(json.dumps({k: v for k, v in run.items() if k not in ("log_tail", "job")} |
                         {"parity": run.get("job", {}).get("parity"), "runs": run.get("job", {}).get("runs")}), flush=True)
        result["runs"][name] = run
        if all(CONFIGS[later][:2] != (dtype, layers) for later in names[i + 1:]):
            os.remove(path)  # the host memory it holds (/dev/shm) goes to the next configuration
        save(a.out, result)
    save(a.out, result, finished=True)


if __name__ == "__main__":
    main()
