"""How accurate are the attention backends H3 can run, alone and inside one DiT block.

Attention at one H3 layer's shape (S = 15,356, 56 x 128 heads) in bf16 with flash, cuDNN and
memory-efficient SDPA against an fp64 reference; one DiT block (layer 0 weights) in bf16 with
flash-first and cuDNN-first attention against the same block in fp32 (error of its update).

  COMFYUI_DIR=/path/to/ComfyUI python bench/h3_accuracy.py --layers 2 --out bench/results/h3_h200_accuracy.json
"""

import torch

from h3_gpu_common import cudnn_first_priority, main


def section_accuracy(ours, out, seq=15356):
    """cuDNN vs flash attention, and one whole DiT block, against fp32 references (fresh inputs)."""
    import copy

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import comfy.ops
    from comfy.ldm.minimax_h3.embedding import rope_rotation_table
    heads, dim, hidden = 56, 128, 5376
    g = torch.Generator("cuda").manual_seed(7)
    res = {}

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    q, k, v = (torch.randn(1, heads, seq, dim, generator=g, device="cuda") for _ in range(3))
    with torch.no_grad():
        ref = torch.cat([F.scaled_dot_product_attention(q[:, i:i + 4].double(), k[:, i:i + 4].double(), v[:, i:i + 4].double())
                         for i in range(0, heads, 4)], dim=1)
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            with sdpa_kernel([backend]):
                res[f"attention_{name}_bf16_rel_err"] = rel(F.scaled_dot_product_attention(*(t.bfloat16() for t in (q, k, v))), ref)
        del ref
        # one DiT block (layer 0 weights) in bf16 with each backend vs the same block in fp32
        block = ours.blocks[0]
        block32 = copy.deepcopy(block).float()
        h = torch.randn(seq, hidden, generator=g, device="cuda")
        t_emb = torch.randn(2, 2688, generator=g, device="cuda")
        angles = torch.randn(seq, 96, generator=g, device="cuda") * 3
        mods = [(0, 512, 1), (512, 1000, 5), (1000, seq, 0)]
        ref = block32(h.clone(), t_emb, mods, rope_rotation_table(angles, torch.float32), {})
        saved = cudnn_first_priority()
        for name, first in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            comfy.ops.SDPA_BACKEND_PRIORITY = [first] + [b for b in saved if b != first]
            outb = block(h.bfloat16(), t_emb.bfloat16(), mods, rope_rotation_table(angles, torch.bfloat16), {})
            res[f"block_{name}_bf16_rel_err_vs_fp32"] = rel(outb - h.bfloat16(), ref - h)  # error of the block's update
        comfy.ops.SDPA_BACKEND_PRIORITY = saved
        del block32
    out["accuracy"] = {"seq": seq, "note": "relative L2 error vs fp64 (attention) / fp32 (block update x_out - x_in) "
                                            "references; random inputs", "results": res}
    print("accuracy: " + ", ".join(f"{k}={v:.2e}" for k, v in res.items()), flush=True)


SECTIONS = {"accuracy": lambda run: section_accuracy(run.ours, run.out)}

if __name__ == "__main__":
    main(__doc__, SECTIONS)
