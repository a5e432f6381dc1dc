"""Shared builders for the H3 tests (importable by spawned rank processes too)."""

import torch

from comfy.ldm.minimax_h3.kernels import pad_to_patch_size
from comfy.ldm.minimax_h3.model import MiniMaxH3Model
from comfy.ldm.minimax_h3.synthetic import TINY_CONFIG, random_state_dict, step_inputs


def tiny_model(dtype=torch.float32, curve=None, seed=0, operations=None, **overrides):
    cfg = dict(TINY_CONFIG, adaln_curve_grid=curve, **overrides)
    m = MiniMaxH3Model(**cfg, dtype=dtype, operations=operations).requires_grad_(False)
    m.load_state_dict(random_state_dict(m, seed=seed))
    return m, cfg


def plan_for(model, cfg, kind="t2va", **kw):
    x, t, c, p = step_inputs(cfg, kind, **kw)
    video = pad_to_patch_size(x[0], model.patch_size)
    c = c.to(model.dtype or torch.float32)
    return model.plan(video, tuple(x[0].shape[2:]), x[1], t, c, {}, p), (video, x[1], c, p), (x, t, c, p)
