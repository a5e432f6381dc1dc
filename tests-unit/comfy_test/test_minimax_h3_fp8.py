import math

import torch

import comfy.ops
from comfy.ldm.minimax.model import MiniMaxH3Model

TINY = {"hidden_size": 64, "num_layers": 2, "token_refiner_num_layers": 1, "num_attention_heads": 4,
        "attention_head_dim": 16, "ffn_hidden_size": 96, "text_dim": 48, "timestep_input_dim": 32,
        "time_embed_hidden_size": 64, "time_embed_dim": 32, "rope_inv_freq_len": 2}


def tiny_model(dtype):
    return MiniMaxH3Model(**TINY, dtype=dtype, operations=comfy.ops.manual_cast).requires_grad_(False)


def random_weights(model, gen):
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("rope.inv_freq"):
            v = 1.0 / (10000.0 ** (torch.arange(t.shape[0], dtype=torch.float64) / t.shape[0]))
        elif "norm" in name:
            v = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        elif t.ndim == 2:
            v = torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[1])
        else:
            v = 0.1 * torch.randn(t.shape, generator=gen)
        out[name] = v.to(t.dtype)
    return out


def test_fp8_weight_storage_computes_as_its_upcast_weights(monkeypatch):
    # UNETLoader's fp8_e4m3fn weight dtype: weights stored in fp8 (the q/k norms too), computed in fp32.
    # comfy.ops' weight and bias function lists are class attributes every layer shares; one test of upstream's
    # tests-unit (comfy_quant's test_weight_function_compatibility) appends a random LoRA to them, so this test
    # starts from empty ones of its own
    monkeypatch.setattr(comfy.ops.CastWeightBiasOp, "weight_function", [])
    monkeypatch.setattr(comfy.ops.CastWeightBiasOp, "bias_function", [])
    gen = torch.Generator("cpu").manual_seed(7)
    fp8, upcast = tiny_model(torch.float8_e4m3fn), tiny_model(torch.float32)
    fp8.load_state_dict(random_weights(fp8, gen))
    upcast.load_state_dict({k: v.float() for k, v in fp8.state_dict().items()})
    assert fp8.blocks[0].attn.q_norm.weight.dtype == torch.float8_e4m3fn
    x = [torch.randn(1, 24, 2, 4, 6, generator=gen), torch.randn(1, 32, 2, 5, generator=gen)]
    timestep, context = torch.tensor([600.0]), torch.randn(1, 7, TINY["text_dim"], generator=gen)
    got = fp8(x, timestep, context, {}, minimax_payload={"seed": 18, "audio_scale": 1.0})
    want = upcast(x, timestep, context, {}, minimax_payload={"seed": 18, "audio_scale": 1.0})
    for g, w in zip(got, want):
        assert torch.isfinite(g).all() and w.abs().max() > 0
        torch.testing.assert_close(g, w, atol=1e-6 * float(w.abs().max()), rtol=0.0)
