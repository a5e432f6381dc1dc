"""MiniMax H3's video VAE decode over the ranks of a sequence-parallel group.

H3's decode (``MiniMaxH3VideoVAE.decode``) is a fixed plan of independent decoder calls, one per
temporal chunk and spatial tile (``_decode_pixels``), blended afterwards. Every rank runs that plan with
the decoder answering on the meta device, which lists the calls and their inputs without decoding;
call k runs on rank k % N, in rounds of N calls. Rank 0 runs the VAE's own decode, each call answered
by the rank that ran it, so the result is ComfyUI's decode: the same calls on the same inputs, blended
by the same code. Each rank holds one tile's activations at a time (ComfyUI's own bound per tile) and
rank 0 the N decoded tiles of a round.
"""

import contextlib
import json

import torch

import comfy.model_management
from comfy.parallel import register_op

from .sequence_parallel import build

OP_VAE_DECODE = "minimax_h3.vae_decode"


@contextlib.contextmanager
def _decoder(model, answer):
    """``model``'s decoder calls answered by ``answer(tile)`` instead."""
    model._decode_pixels = answer
    try:
        yield
    finally:
        del model._decode_pixels


def _tile_output(model, tile, device):
    b, _, t, h, w = tile.shape
    return torch.empty(b, model.decoder.out_channels, t * model.vae_ratio_t, h * model.vae_ratio, w * model.vae_ratio,
                       dtype=tile.dtype, device=device)


def tile_inputs(model, z):
    """The inputs of the decoder calls ``model.decode(z)`` makes, in order (no decoder runs)."""
    calls = []

    def record(tile):
        calls.append(tile)
        return _tile_output(model, tile, "meta")
    with _decoder(model, record):
        model.decode(z, output_buffer=torch.empty(model.decode_output_shape(z.shape), device="meta"))
    return calls


@register_op(OP_VAE_DECODE)
def vae_decode_op(ctx, meta):
    """Every rank decodes its share of the tiles; rank 0 blends them into ``output_buffer`` as the VAE does."""
    if ctx.rank == 0:
        model, z, output_buffer = ctx.state.pop("vae_decode")
    else:
        vaes = ctx.state.setdefault("vaes", {})
        key = json.dumps(meta["call"], sort_keys=True)
        if key not in vaes:
            vaes.clear()  # one VAE at a time, as a workflow decodes with one
            vaes[key] = build(meta["call"])
        # built by rank 0's code, flags and kind of device (the group's setup checked them): in rank 0's dtype
        comfy.model_management.load_models_gpu([vaes[key]], memory_required=meta["memory_required"])
        model = vaes[key].model
        z = torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"].removeprefix("torch.")), device=ctx.device)
    ctx.transport.broadcast([z])
    n = ctx.world_size
    calls = tile_inputs(model, z)
    rounds = [calls[i:i + n] for i in range(0, len(calls), n)]

    def run_round(tiles):
        """This rank's tile of the round decoded; on rank 0 -> the round's decoded tiles."""
        mine = type(model)._decode_pixels(model, tiles[ctx.rank]).contiguous() if ctx.rank < len(tiles) else None
        sizes = [[0] * n for _ in range(n)]
        for i, tile in enumerate(tiles[1:], 1):
            sizes[i][0] = _tile_output(model, tile, "meta").nbytes
        if ctx.rank:
            ctx.transport.all_to_all([mine] + [None] * (n - 1), [None] * n, sizes).wait()
            return None
        got = [None] + [_tile_output(model, tile, z.device) for tile in tiles[1:]] + [None] * (n - len(tiles))
        ctx.transport.all_to_all([None] * n, got, sizes).wait()
        return [mine] + got[1:len(tiles)]
    if ctx.rank:
        for tiles in rounds:
            run_round(tiles)
        return len(range(ctx.rank, len(calls), n))  # the tiles it decoded
    answers = []

    def answer(tile):
        if not answers:
            answers.extend(run_round(rounds.pop(0)))
        return answers.pop(0)
    with _decoder(model, answer):
        return model.decode(z, output_buffer=output_buffer)


def decode(sp, call, model, z, output_buffer, memory_required):
    """``model.decode(z, output_buffer)`` over ``sp``'s group (a SequenceParallel whose workers are up)."""
    sp._rank0["vae_decode"] = (model, z.contiguous(), output_buffer)
    try:
        return sp.group.run(OP_VAE_DECODE, {"call": call, "shape": list(z.shape), "dtype": str(z.dtype),
                                            "memory_required": memory_required}).values[0]
    finally:
        sp._rank0.pop("vae_decode", None)
