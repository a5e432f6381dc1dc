"""H3's kernel calls: attention through ComfyUI's selection, the fused q/k RMSNorm + rope and the
fused RMSNorm + adaLN of comfy_kitchen, and the allocation-graph / per-block prefetch scopes of
ComfyUI's model compiler where the core has them (feature-detected; no-ops elsewhere). Internal.

``optimized_attention`` is looked up on every call, so replacing it here (or through the
``comfy.ldm.minimax.model`` re-export, as custom nodes do) changes the attention H3 runs.
"""

import contextlib
import functools
import inspect

import torch

import comfy.model_management
import comfy.model_prefetch
import comfy.quant_ops
from comfy.ldm.modules.attention import AttentionTensorContainer, optimized_attention


def attention(q, k, v, heads, transformer_options):
    """[S, h, D] q, k, v (any strides, never modified) -> [S, h*D]; no mask, every row is a key.

    ComfyUI picks the backend (start-up flags, the attention-backend node's override; PyTorch SDPA's
    backend order is ``comfy.ops.SDPA_BACKEND_PRIORITY``).
    """
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, S, D]
    # ComfyUI's backends may take ownership of the containers' tensors: v gets its own storage, as upstream does
    out = optimized_attention(AttentionTensorContainer(q), AttentionTensorContainer(k), AttentionTensorContainer(v.clone()),
                              heads, mask=None, skip_reshape=True, transformer_options=transformer_options)
    return out.squeeze(0)


def rms_rope_(q, k, rope, q_weight, k_weight, eps):
    """Per-head RMSNorm + partial split-half rope of q, k ([1, S, H, D] views), in place when allowed.

    rope: [1, S, 1, rot/2, 2, 2] rotation table. Returns (q, k).
    """
    rot = rope.shape[-3] * 2
    if not rms_rope_in_place():
        return comfy.quant_ops.ck.rms_rope_split_half(q, k, rope, q_weight, k_weight, epsilon=eps, rot_dim=rot)
    comfy.quant_ops.ck.rms_rope_split_half_(q, k, rope, q_weight, k_weight, epsilon=eps, rot_dim=rot)
    return q, k


def rms_rope_in_place():
    """Whether rms_rope_ writes into q and k (inference); in training it returns new tensors."""
    return not comfy.model_management.in_training


def fused_adaln(x):
    """Whether RMSNorm + adaLN modulation run as one fused kernel for x (CUDA inference).

    Elsewhere the unfused ops run, which keeps CPU outputs bit-identical to upstream's model.
    """
    return x.is_cuda and not comfy.model_management.in_training


def rms_adaln(x, scale, shift, eps):
    """rmsnorm(x) * (1 + scale) + shift (no norm weight), comfy_kitchen's fused kernel -> new tensor."""
    return comfy.quant_ops.ck.rms_adaln(x, scale, shift, eps=eps)


@functools.lru_cache(maxsize=None)
def _parameters(fn):
    return tuple(inspect.signature(fn).parameters)


@contextlib.contextmanager
def malloc_graph(module, like):
    """One forward of `module` inside ComfyUI's allocation graph where the core compiles them (its
    ``malloc_graph_enabled`` holds for the device), else plainly.

    like: the forward's [video, audio] inputs. Yields ``keep(outputs)``, which copies the outputs into
    tensors allocated before the graph began, so that they outlive it; a no-op without a graph.
    """
    prefetch = comfy.model_prefetch
    device = like[0].device
    enabled = getattr(prefetch, "malloc_graph_enabled", None)
    if enabled is None or not enabled(device):
        yield lambda outputs: outputs
        return
    kept = [torch.empty_like(t) for t in like]

    def keep(outputs):
        for k, o in zip(kept, outputs):
            k.copy_(o)
        return kept
    # cores keep the graph per thread (begin(device)) or on the module (begin(module, device))
    begin = prefetch.malloc_graph_begin
    begin(*((module, device) if len(_parameters(begin)) >= 2 else (device,)))
    try:
        yield keep
    finally:
        prefetch.malloc_graph_end()


def prefetch_pop(queue, device, module):
    """ComfyUI's per-block prefetch step before `module` runs (None after the last block), in the
    "block" allocation scope where the core scopes them, which also closes the last block's scope."""
    pop = comfy.model_prefetch.prefetch_queue_pop
    if "malloc_scope" in _parameters(pop):
        pop(queue, device, module, malloc_scope="block")
    elif module is not None or queue is not None:
        pop(queue, device, module)
