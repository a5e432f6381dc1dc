"""Where H3's attention call spends time on a GPU: raw cuDNN SDPA on the q|k|v buffer views, with v
cloned (as upstream's Attention does), through minimax_h3.kernels.attention, and the whole Attention
module with and without the v clone. One H3 layer's shapes (S = 15,356, 56 x 128 heads), bf16.

  python bench/h3_attention_layouts.py --out bench/results/h3_attention_layouts.json
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import comfy.ops  # noqa: E402
from comfy.ldm.minimax_h3 import kernels  # noqa: E402
from comfy.ldm.minimax_h3.embedding import rope_rotation_table  # noqa: E402
from comfy.ldm.minimax_h3.modules import Attention  # noqa: E402
from h3_gpu_common import cuda_time  # noqa: E402


def bench(fn):
    t = cuda_time(fn, warmup=5, iters=30, budget_s=1e9)  # no time budget: always 30 repeats
    return {"median_ms": t["median_s"] * 1e3, "min_ms": t["min_s"] * 1e3, "max_ms": t["max_s"] * 1e3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=15356)
    args = ap.parse_args()
    s, h, d, hidden = args.seq, 56, 128, 5376
    g = torch.Generator("cuda").manual_seed(0)
    qkv = torch.randn(s, 3 * h * d, generator=g, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(s, h, d) for t in qkv.split(h * d, dim=-1))
    vc = v.clone()
    res = {}
    with torch.no_grad():
        def raw(vv):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, vv)))
        res["cudnn_raw_views"] = bench(lambda: raw(v))
        res["cudnn_raw_v_cloned"] = bench(lambda: raw(vc))
        res["kernels_attention_views"] = bench(lambda: kernels.attention(q, k, v, h, {}))
        res["kernels_attention_v_cloned"] = bench(lambda: kernels.attention(q, k, vc, h, {}))
        res["kernels_attention_v_clone_inside"] = bench(lambda: kernels.attention(q, k, v.clone(), h, {}))
        out = raw(v)
        res["output_transpose_reshape_copy"] = bench(lambda: out.transpose(1, 2).reshape(s, h * d).contiguous())
        res["output_strides"] = list(out.stride())
        attn = Attention(hidden, h, d, 1e-5, dtype=torch.bfloat16, device="cuda", operations=comfy.ops.disable_weight_init)
        for p in attn.parameters():
            p.requires_grad_(False).normal_(0, 0.02, generator=g)
        x = torch.randn(s, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
        rope = rope_rotation_table(torch.randn(s, 96, generator=g, device="cuda"), torch.bfloat16)
        res["attention_module"] = bench(lambda: attn(x, rope_freqs=rope))
    print(json.dumps(res, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "seq": s, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
