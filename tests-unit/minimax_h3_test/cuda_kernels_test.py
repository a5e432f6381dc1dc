"""CUDA-only checks of the kernels H3 runs on GPUs (skipped without a CUDA device).

The sequence-parallel path norms + ropes q and k one head chunk at a time, in place, with
comfy_kitchen's fused kernel on [1, S, h, D] views that start mid-row of the q|k|v buffer; it must
give exactly what one call over all heads gives.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (comfy_kitchen's CUDA kernels)")


@pytest.mark.parametrize("spans", [[(0, 32), (32, 56)], [(0, 7), (7, 14), (14, 56)], [(0, 4), (4, 8), (8, 11), (11, 56)]])
def test_chunked_in_place_norm_rope_equals_one_call(spans):
    import comfy.ops
    from comfy.ldm.minimax_h3.embedding import rope_rotation_table
    from comfy.ldm.minimax_h3.modules import Attention

    torch.manual_seed(0)
    heads, dim, rows = 56, 128, 777
    attn = Attention(5376, heads, dim, 1e-6, dtype=torch.bfloat16, device="cuda", operations=comfy.ops.disable_weight_init)
    attn.requires_grad_(False)  # inference weights, as loaded for sampling
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
        rope = rope_rotation_table(torch.randn(rows, 96, device="cuda"), torch.bfloat16)  # partial rope: 96 of 128 dims
        qkv = torch.randn(rows, 3, heads, dim, device="cuda", dtype=torch.bfloat16)
        whole, chunked = qkv.clone(), qkv.clone()
        q, k = attn.norm_qk(whole, 0, heads, rope)
        assert q.data_ptr() == whole[:, 0].data_ptr()  # in place (inference)
        for a, b in spans:
            attn.norm_qk(chunked, a, b, rope)
        assert torch.equal(chunked, whole)
        assert not torch.equal(whole[:, :2], qkv[:, :2]) and torch.equal(whole[:, 2], qkv[:, 2])  # q, k changed, v not
