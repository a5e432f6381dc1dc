"""Compatibility re-export: MiniMax H3 lives in ``comfy.ldm.minimax_h3``; new code imports from there.

Every name upstream's module defined is here, under its old name, as the package's own object;
setting ``optimized_attention`` here swaps the attention function H3 calls, as it did upstream.
This module only promises what upstream's module offers (newer upstream names included) and nothing more.
"""

import sys
import types

from comfy.ldm.minimax_h3 import H3_EXTENSION_API  # noqa: F401
from comfy.ldm.minimax_h3 import kernels as _kernels
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

# Names newer upstream modules added (after 0f1fa67), same signatures and results.
from comfy.ldm.minimax_h3.embedding import mask_row_values  # noqa: F401
from comfy.ldm.minimax_h3.pdd import pdd_head as _pdd_head  # noqa: F401


class _ReexportModule(types.ModuleType):
    # upstream's Attention looked optimized_attention up in this module on every call, so custom
    # nodes replace it here; H3 looks it up in kernels
    @property
    def optimized_attention(self):
        return _kernels.optimized_attention

    @optimized_attention.setter
    def optimized_attention(self, fn):
        _kernels.optimized_attention = fn


sys.modules[__name__].__class__ = _ReexportModule
