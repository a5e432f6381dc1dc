"""The few core facilities H3 calls: attention, fused q/k RMSNorm + rope, SwiGLU down projection,
weight casting, patch padding, wrappers and block prefetch. Internal.

Inside a ComfyUI tree these are ComfyUI's own (so attention backends, overrides, quantised layers,
offloading and prefetch behave exactly as for every other model). Standalone (tests, workers
without ComfyUI) they fall back to comfy_kitchen's fused kernel and plain torch. No numerics of
our own where a maintained kernel exists.
"""

import torch
import torch.nn.functional as F

try:
    import comfy.model_management as _mm
except ModuleNotFoundError as e:
    if e.name not in ("comfy.model_management", "comfy"):
        raise
    _mm = None

if _mm is not None:
    import comfy.ldm.common_dit
    import comfy.ldm.modules.attention as _attention
    import comfy.model_prefetch
    import comfy.ops
    import comfy.patcher_extension
    import comfy.quant_ops
    from comfy.ldm.modules.attention import AttentionTensorContainer, optimized_attention
    _ck = comfy.quant_ops.ck
else:
    import comfy_kitchen as _ck

IN_COMFYUI = _mm is not None

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    # H3's attention (56 x 128 heads, 15k-40k keys, no mask) runs 1.7x faster on cuDNN than on
    # flash on an H200 (11.1 vs 19.0 ms per block at 15,356 tokens, bench/results/h3_h200_*.json);
    # ComfyUI's generic SDPA wrapper puts flash first for every model.
    SDPA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                     SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
except ImportError:
    SDPA_PRIORITY = None


def _own_sdpa(q, transformer_options):
    """Use H3's SDPA backend priority: on CUDA, unless ComfyUI runs another attention backend
    (sage, flash-attn, xformers, split) or an override asks for something else."""
    if SDPA_PRIORITY is None or not q.is_cuda:
        return False
    if not IN_COMFYUI:
        return True
    return optimized_attention is _attention.attention_pytorch and "optimized_attention_override" not in transformer_options


def cast_to(weight, device, dtype=None):
    """A raw weight or buffer on `device` at `dtype` (None: as stored) for direct arithmetic.

    Pass the compute dtype wherever the tensor meets activations: weights may be stored in fp8
    (UNETLoader weight_dtype fp8_*), which kernels and most ops reject.
    """
    return _mm.cast_to(weight, dtype=dtype, device=device) if IN_COMFYUI else weight.to(device=device, dtype=dtype)


def in_training():
    return bool(IN_COMFYUI and _mm.in_training)


def attention(q, k, v, heads, transformer_options):
    """[S, h, D] q, k, v (any strides, never modified) -> [S, h*D]; no mask, every row is a key."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, S, D]
    if _own_sdpa(q, transformer_options):
        with sdpa_kernel(SDPA_PRIORITY, set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(q.shape[2], heads * q.shape[3])
    if IN_COMFYUI:
        # ComfyUI's backends may take ownership of the containers' tensors: v gets its own storage, as upstream does
        out = optimized_attention(AttentionTensorContainer(q), AttentionTensorContainer(k), AttentionTensorContainer(v.clone()),
                                  heads, mask=None, skip_reshape=True, transformer_options=transformer_options)
        return out.squeeze(0)
    out = F.scaled_dot_product_attention(q, k, v)  # [1, h, S, D]
    return out.transpose(1, 2).reshape(q.shape[2], heads * q.shape[3])


def rms_rope_(q, k, rope, q_weight, k_weight, eps):
    """Per-head RMSNorm + partial split-half rope of q, k ([1, S, H, D] views), in place when allowed.

    rope: [1, S, 1, rot/2, 2, 2] rotation table. Returns (q, k).
    """
    rot = rope.shape[-3] * 2
    if not rms_rope_in_place():
        return _ck.rms_rope_split_half(q, k, rope, q_weight, k_weight, epsilon=eps, rot_dim=rot)
    _ck.rms_rope_split_half_(q, k, rope, q_weight, k_weight, epsilon=eps, rot_dim=rot)
    return q, k


def rms_rope_in_place():
    """Whether rms_rope_ writes into q and k (inference); in training it returns new tensors."""
    return not in_training()


def fused_adaln(x):
    """Whether RMSNorm + adaLN modulation run as one fused kernel for x (CUDA inference).

    Elsewhere the unfused ops run, which keeps CPU outputs bit-identical to upstream's model.
    """
    return x.is_cuda and not in_training()


def rms_adaln(x, scale, shift, eps):
    """rmsnorm(x) * (1 + scale) + shift (no norm weight), comfy_kitchen's fused kernel -> new tensor."""
    return _ck.rms_adaln(x, scale, shift, eps=eps)


def swiglu_linear(linear, x):
    """linear(silu(gate) * up) with x = [gate | up]; INT8 layers fold the activation in ComfyUI."""
    if IN_COMFYUI:
        return comfy.ops.linear_input_act(linear, x, "swiglu")
    gate, up = x.chunk(2, dim=-1)
    return linear(F.silu(gate).mul_(up))


def pad_to_patch_size(x, patch_size):
    if IN_COMFYUI:
        return comfy.ldm.common_dit.pad_to_patch_size(x, patch_size)
    pad = ()
    for i in range(x.ndim - 2):
        pad = (0, (patch_size[i] - x.shape[i + 2] % patch_size[i]) % patch_size[i]) + pad
    return F.pad(x, pad, mode="circular")


def run_with_wrappers(fn, owner, transformer_options, *args, **kwargs):
    """Run fn through ComfyUI's DIFFUSION_MODEL wrappers (none outside ComfyUI)."""
    if not IN_COMFYUI:
        return fn(*args, **kwargs)
    wrappers = comfy.patcher_extension.get_all_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
    return comfy.patcher_extension.WrapperExecutor.new_class_executor(fn, owner, wrappers).execute(*args, **kwargs)


def make_prefetch_queue(blocks, device, transformer_options):
    return comfy.model_prefetch.make_prefetch_queue(list(blocks), device, transformer_options) if IN_COMFYUI else None


def prefetch_queue_pop(queue, device, block):
    if queue is not None:
        comfy.model_prefetch.prefetch_queue_pop(queue, device, block)


def default_operations():
    """Layer factory when the caller passes none: ComfyUI's casting ops, else plain torch.nn."""
    if IN_COMFYUI:
        return comfy.ops.disable_weight_init
    return _TorchOps


class _RMSNorm(torch.nn.RMSNorm):
    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, dtype=None, device=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, dtype=dtype, device=device)


class _TorchOps:
    Linear = torch.nn.Linear
    RMSNorm = _RMSNorm
