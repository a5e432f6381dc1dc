"""A small MiniMax H3 video VAE built by ComfyUI's own VAE class: upstream's MiniMaxH3VideoVAE with fewer
channels and decoder layers (its temporal chunks and 256-pixel tiles unchanged), loaded from a safetensors
file. ``load_patcher`` is the VAE's cached_patcher_init factory, which the workers of the sequence-parallel
tests import from this module (a custom node's loader would be imported alike)."""

import contextlib

import torch
from safetensors.torch import save_file

import comfy.sd
from comfy.ldm.minimax import vae as h3_vae


@contextlib.contextmanager
def _small():
    """H3's VAE classes build small while inside: encoder ch 32 with one res block, a 2-layer 2x16 decoder."""
    vae_init, decoder_init = h3_vae.MiniMaxH3VideoVAE.__init__, h3_vae.ViT3DDecoder.__init__
    vae_defaults, decoder_defaults = vae_init.__defaults__, decoder_init.__defaults__
    vae_init.__defaults__ = (3, 3, 32, 24, 24, (1, 1, 1, 1, 1, 1), 1) + vae_defaults[7:]
    decoder_init.__defaults__ = decoder_defaults[:4] + (2, 2, 16) + decoder_defaults[7:]
    try:
        yield
    finally:
        vae_init.__defaults__, decoder_init.__defaults__ = vae_defaults, decoder_defaults


def write_file(path, seed=0):
    with _small():
        model = h3_vae.MiniMaxH3VideoVAE()
    g = torch.Generator().manual_seed(seed)
    sd = {k: (v if k.startswith("latents_") else torch.randn(v.shape, generator=g) * 0.2) for k, v in model.state_dict().items()}
    save_file(sd, path)


def load_patcher(path):
    return load(path).patcher


def load(path):
    """ComfyUI's VAE of the file, as VAELoader makes it (with the factory that loads it again)."""
    with _small():
        vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(path))
    vae.throw_exception_if_invalid()
    vae.patcher.cached_patcher_init = (load_patcher, (path,))
    return vae
