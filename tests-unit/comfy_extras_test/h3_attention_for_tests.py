"""An attention function registered by name, as a custom node registers one; the workers of the sequence
parallel tests import this module (by the name rank 0 imported it under) to have it too."""

from comfy.ldm.modules import attention

NAME = "h3sp_test_scaled_pytorch"


def scaled_pytorch_attention(q, k, v, heads, **kwargs):
    return attention.attention_pytorch(q, k, v, heads, **kwargs) * 0.5


attention.register_attention_function(NAME, scaled_pytorch_attention)
