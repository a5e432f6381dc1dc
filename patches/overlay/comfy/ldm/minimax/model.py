"""Compatibility re-export: MiniMax H3 now lives in ``comfy.ldm.minimax_h3``.

This module exists so that ``comfy.model_base``, ``comfy_extras.nodes_minimax_h3`` and custom nodes
keep importing the names they always imported from ``comfy.ldm.minimax.model``: the model, the
packed layout, the timestep constants, the patchify/pack helpers, the ``nn.Module``s (same
constructor arguments, same state-dict keys) and the private helpers custom nodes are known to
copy. Each name is the same object as in the package, so ``isinstance`` checks and monkeypatching a
class work on either name. The VAEs in this directory (``vae.py``, ``audio_vae.py``) are unchanged.

New code should import from ``comfy.ldm.minimax_h3``; its ``H3_EXTENSION_API`` (major, minor) is the
versioned interface (layout, conditioning, modulation, ForwardPlan / ShardPlan, ``run``). This
module only promises what upstream's module offered and will not grow.

Not re-exported: the names upstream's module merely imported (``math``, ``torch``, ``nn``,
``comfy``, ``optimized_attention``, ``AttentionTensorContainer``). H3's attention call lives in
``comfy.ldm.minimax_h3.kernels`` and follows ComfyUI's attention selection as before.
"""

from comfy.ldm.minimax_h3 import H3_EXTENSION_API  # noqa: F401
from comfy.ldm.minimax_h3.conditioning import AUDIO_COND_TIMESTEP, VISUAL_COND_TIMESTEP, time_shift_sigma
from comfy.ldm.minimax_h3.embedding import pack_audio, patchify_video, rope_rotation_table, unpack_audio, unpatchify_video
from comfy.ldm.minimax_h3.layout import FRAME_PER_TOKEN, FRAME_RESCALE, PackedLayout
from comfy.ldm.minimax_h3.model import MiniMaxH3Model
from comfy.ldm.minimax_h3.modules import MLP, AdalnProj, Attention, DiTBlock, FinalLayer, RefinerBlock, TimeEmbedder, TokenRefiner

__all__ = [
    "MiniMaxH3Model", "PackedLayout",
    "FRAME_PER_TOKEN", "FRAME_RESCALE", "VISUAL_COND_TIMESTEP", "AUDIO_COND_TIMESTEP",
    "time_shift_sigma", "patchify_video", "unpatchify_video", "pack_audio", "unpack_audio", "rope_rotation_table",
    "TimeEmbedder", "Attention", "MLP", "AdalnProj", "RefinerBlock", "TokenRefiner", "DiTBlock", "FinalLayer",
]

# Private helpers of upstream's module that custom nodes are known to copy, under their old names.
# Same signatures and results; _frame_grid returns the same (grid [n, 2], w axis) pair.
from comfy.ldm.minimax_h3.layout import _axis_from_sqrt_area  # noqa: F401
from comfy.ldm.minimax_h3.layout import audio_positions as _audio_grid  # noqa: F401
from comfy.ldm.minimax_h3.layout import frame_grid as _frame_grid  # noqa: F401
from comfy.ldm.minimax_h3.layout import ref_t_span as _ref_t_span  # noqa: F401
from comfy.ldm.minimax_h3.layout import video_positions as _video_grid  # noqa: F401
from comfy.ldm.minimax_h3.layout import video_t_grid as _video_t_grid  # noqa: F401
from comfy.ldm.minimax_h3.layout import video_t_spans as _video_t_spans  # noqa: F401
from comfy.ldm.minimax_h3.modulation import mod_gate as _mod_gate  # noqa: F401
from comfy.ldm.minimax_h3.modulation import mod_scale_shift as _mod_scale_shift  # noqa: F401
