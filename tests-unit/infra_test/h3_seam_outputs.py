"""python h3_seam_outputs.py CASES_DIR OUT: every case of CASES_DIR/minimax_h3_cases.py, run by the ComfyUI
tree on the path, written to OUT (safetensors), so that two trees can be compared bit for bit."""

import json
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, sys.argv[1])
import minimax_h3_cases as cases  # noqa: E402

tensors = {}
for name in cases.CASES:
    video, audio = cases.run_case(name)
    tensors[f"{name}.video"], tensors[f"{name}.audio"] = video.contiguous(), audio.contiguous()
manifest = {"seed": cases.SEED, "config": cases.TINY, "cases": {k: {"model": m, "inputs": i} for k, (m, i) in cases.CASES.items()},
            "torch": torch.__version__}
save_file(tensors, sys.argv[2], metadata={"manifest": json.dumps(manifest, sort_keys=True)})
