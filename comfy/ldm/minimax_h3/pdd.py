"""PDD head banks of few-step H3 checkpoints: the heads of the bank a step spans, picked once per
step by the plan (pure CPU data, the same on every rank), and the output head FinalLayer runs.

A bank output layer holds ``n`` heads as weight [n * out, in] and bias [n * out]: head 0 is a full
head, heads 1.. are offsets from it. A step from sigma to the next sampler sigma uses head 0 plus the
offsets of the heads its span covers on the n-step grid, weighted by each head's share of the span.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

import comfy.ops

from .conditioning import time_shift_sigma


def bank_size(linear):
    """Heads in an output layer: a PDD LoRA sets its weight to [n * out_features, in]; 1 without one."""
    return linear.weight.shape[0] // linear.out_features


def head_shares(heads, start, stop, shift):
    """[stop - start] float64 shares of heads start..stop-1 in a step: each head's span on the time grid
    of a stream with this sigma shift, normalised over the step."""
    grid = torch.linspace(1.0, 0.0, heads + 1, dtype=torch.float64)
    dt = (1.0 - shift * grid / (1.0 + (shift - 1.0) * grid)).diff()[start:stop]
    return dt / dt.sum()


def pdd_head(linear, h, heads, start, stop, shift):
    """h [rows, in] through the head of `linear`'s bank a step over heads [start, stop) runs -> [rows, out]."""
    first = max(start, 1)  # head 0 always enters whole; at start 0 its share goes unused
    share = head_shares(heads, start, stop, shift).to(h)[first - start:]
    with comfy.ops.CastBiasWeightContext(linear, h, offloadable=True) as (weight, bias):
        bank_w, bank_b = weight.unflatten(0, (heads, -1)), bias.unflatten(0, (heads, -1))
        head_w = bank_w[0] + torch.tensordot(share, bank_w[first:stop], dims=1)
        head_b = bank_b[0] + torch.tensordot(share, bank_b[first:stop], dims=1)
        return nn.functional.linear(h, head_w, head_b)


@dataclass(frozen=True)
class PddHeads:
    heads: int          # n, the bank size
    start: int          # the step spans heads [start, stop) of the n-step grid
    stop: int
    shifts: tuple       # (video, audio) sigma shifts: each stream weighs the heads on its own time grid

    @classmethod
    def select(cls, heads, sigma, sample_sigmas, shifts):
        """The heads a step at video sigma spans; shifts = (video, audio) sigma shifts."""
        if sample_sigmas is None:
            raise ValueError("MiniMax H3 PDD heads need the sampler's sigma schedule: this model's output layers hold a "
                             f"bank of {heads} heads (a PDD LoRA) and transformer_options has no 'sample_sigmas'. "
                             "Sample with a ComfyUI sampler, or remove the PDD LoRA")
        sigmas = torch.as_tensor(sample_sigmas).detach().to("cpu", torch.float32).reshape(-1)
        sigma = torch.tensor(float(sigma), dtype=torch.float32)
        i = int((sigmas - sigma).abs().argmin())
        following = sigmas[min(i + 1, sigmas.shape[0] - 1)]
        # both ends map to the unshifted grid through the video shift
        start, stop = (round(float(1.0 - time_shift_sigma(s, shifts[0], 1.0)) * heads) for s in (sigma, following))
        start = min(start, heads - 1)
        return cls(heads, start, max(stop, start + 1), tuple(float(s) for s in shifts))

    def describe(self):
        return {"heads": self.heads, "start": self.start, "stop": self.stop, "shifts": [s.hex() for s in self.shifts]}

    def apply(self, linear, h, stream):
        """linear's bank mixed for this step, applied to h [rows, in] -> [rows, out]; stream 0 video, 1 audio."""
        if bank_size(linear) != self.heads:
            raise ValueError(f"MiniMax H3 plan picked PDD heads of a {self.heads}-head bank, but the output layer holds "
                             f"{bank_size(linear)}: the model's patches changed during the step")
        return pdd_head(linear, h, self.heads, self.start, self.stop, self.shifts[stream])
