import pytest
import torch

import comfy.ops
import minimax_h3_cases as cases


@pytest.mark.parametrize("name", ["t2va", "refs_all"])
def test_fp8_weight_storage_computes_as_its_upcast_weights(name):
    # UNETLoader's fp8_e4m3fn weight dtype: weights stored in fp8 (the q/k norms too), computed in fp32
    fp8 = cases.build_model({"dtype": "float8_e4m3fn"}, operations=comfy.ops.manual_cast)
    upcast = cases.build_model({}, operations=comfy.ops.manual_cast)
    upcast.load_state_dict({k: v.float() for k, v in fp8.state_dict().items()})
    assert fp8.blocks[0].attn.q_norm.weight.dtype == torch.float8_e4m3fn
    x, timestep, context, payload, kwargs, options = cases.case_inputs(name, torch.float32)
    got = fp8(x, timestep, context, dict(options), minimax_payload=payload, **kwargs)
    want = upcast(x, timestep, context, dict(options), minimax_payload=payload, **kwargs)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, atol=1e-6 * float(w.abs().max()), rtol=0.0)
