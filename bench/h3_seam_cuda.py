"""Does patch 0001 change a number or a kernel on CUDA? Runs every case of
tests-unit/comfy_test/minimax_h3_cases.py on the GPU in one ComfyUI tree (cwd) and writes each case's
outputs and the sequence of CUDA kernels its forward launched (torch.profiler), for
``--compare A B`` to diff between the unpatched and the patched tree.

    cd <tree> && python bench/h3_seam_cuda.py --out OUT.safetensors     (once per tree)
    python bench/h3_seam_cuda.py --compare BASE.safetensors PATCHED.safetensors --json RESULT.json
"""

import argparse
import json
import os
import platform
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))


def record(out):
    sys.path.insert(0, os.getcwd())
    sys.path.insert(0, os.path.join(HERE, "..", "tests-unit", "comfy_test"))
    import minimax_h3_cases as cases
    tensors, kernels = {}, {}
    for name in cases.CASES:
        cases.run_case(name, device="cuda")  # warm-up: lazy inits and autotuning outside the record
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            video, audio = cases.run_case(name, device="cuda")
            torch.cuda.synchronize()
        kernels[name] = [e.name for e in sorted(prof.events(), key=lambda e: e.time_range.start)
                         if e.device_type == torch.autograd.DeviceType.CUDA]
        tensors[f"{name}.video"], tensors[f"{name}.audio"] = video.cpu().contiguous(), audio.cpu().contiguous()
    meta = {"kernels": kernels, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "tree": os.getcwd()}
    save_file(tensors, out, metadata={"meta": json.dumps(meta)})


def compare(a, b, out):
    result = {"cases": {}}
    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        ma, mb = json.loads(fa.metadata()["meta"]), json.loads(fb.metadata()["meta"])
        for name in ma["kernels"]:
            same = all(torch.equal(fa.get_tensor(f"{name}.{s}"), fb.get_tensor(f"{name}.{s}")) for s in ("video", "audio"))
            ka, kb = ma["kernels"][name], mb["kernels"][name]
            result["cases"][name] = {"bit_identical": same, "kernels": len(ka), "same_kernel_sequence": ka == kb,
                                     "same_kernels": sorted(ka) == sorted(kb)}
    result.update(machine=platform.node(), gpu=ma["gpu"], torch=ma["torch"],
                  all_bit_identical=all(c["bit_identical"] for c in result["cases"].values()),
                  all_same_kernels=all(c["same_kernels"] for c in result["cases"].values()),
                  all_same_kernel_sequence=all(c["same_kernel_sequence"] for c in result["cases"].values()))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--compare", nargs=2)
    p.add_argument("--json", default="h3_seam_cuda.json")
    a = p.parse_args()
    compare(*a.compare, a.json) if a.compare else record(a.out)
