"""Shared builders for the H3 tests (importable by spawned rank processes too)."""

from typing import NamedTuple

import torch

from comfy.ldm.minimax_h3.model import MiniMaxH3Model
from comfy.ldm.minimax_h3.plan import ForwardPlan
from comfy.ldm.minimax_h3.step_io import StepInputs
from h3_files import TINY_CONFIG, random_state_dict, step_inputs


def tiny_model(dtype=torch.float32, curve=None, seed=0, operations=None, **overrides):
    cfg = dict(TINY_CONFIG, adaln_curve_grid=curve, **overrides)
    m = MiniMaxH3Model(**cfg, dtype=dtype, operations=operations).requires_grad_(False)
    m.load_state_dict(random_state_dict(m, seed=seed))
    return m, cfg


class Case(NamedTuple):
    """One step: the model's plan and StepInputs for it, and forward()'s own arguments."""
    plan: ForwardPlan
    inputs: StepInputs
    x: list
    timestep: torch.Tensor
    context: torch.Tensor
    payload: dict

    def forward(self, model, options=None):
        """The native forward of this step, as the sampler calls it."""
        return model(self.x, self.timestep, self.context, dict(options or {}), minimax_payload=self.payload)


def plan_for(model, cfg, kind="t2va", **kw):
    x, t, c, p = step_inputs(cfg, kind, **kw)
    c = c.to(model.dtype or torch.float32)
    inputs = StepInputs(x[0], x[1], t, c, p, {})
    return Case(model.plan(inputs), inputs, x, t, c, p)
