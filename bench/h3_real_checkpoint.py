"""Write a real-size MiniMax H3 checkpoint with random weights (a safetensors file ComfyUI's UNETLoader
reads), streamed tensor by tensor so that no copy of the whole model is held in RAM.

Every tensor's shape and dtype are those of comfy/ldm/minimax/model.py at the given dtype (the
model's fp32 islands stay fp32); values are random, drawn on the GPU when there is one: matrices normal
with std 1/sqrt(fan_in) (the adaLN projections half that), biases 0, norms 1, rope as the model's. At
that scale every block adds a few per cent to the stream and 50 blocks neither blow up nor fade out, so
two runs differ by bf16 rounding and a sharded-vs-native difference means something (std 0.02 at H3's
width grows the stream block by block until the model is chaotic: the same workflow twice on CUDA then
differed by 11 %).

  python bench/h3_real_checkpoint.py --out /dev/shm/h3_fp8.safetensors --dtype float8_e4m3fn
  python bench/h3_real_checkpoint.py --out /dev/shm/h3_bf16_25.safetensors --dtype bfloat16 --layers 25
"""

import argparse
import json
import os
import sys
import time

import torch

PREFIX = "model.diffusion_model."
NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3"}


def random_value(name, shape, gen, device):
    """A tensor's random value as this file's docstring says."""
    if "norm" in name.split(".")[-2]:
        return torch.ones(shape, device=device)
    if len(shape) < 2:
        return torch.zeros(shape, device=device)
    std = shape[1] ** -0.5 * (0.5 if "adaln_proj" in name else 1.0)
    return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float8_e4m3fn", choices=("float8_e4m3fn", "bfloat16"))
    ap.add_argument("--layers", type=int, default=50)
    a = ap.parse_args()
    sys.path.insert(0, os.getcwd())
    if not torch.cuda.is_available():
        from comfy.cli_args import args
        args.cpu = True
    import comfy.ops
    from comfy.ldm.minimax.model import MiniMaxH3Model
    dtype = getattr(torch, a.dtype)
    # fp8 storage: the model's compute-dtype linears in fp8 (what UNETLoader's fp8 weight_dtype holds), islands fp32
    probe = MiniMaxH3Model(num_layers=a.layers, dtype=torch.bfloat16, device="meta", operations=comfy.ops.disable_weight_init).state_dict()
    spec = {k: (tuple(t.shape), dtype if t.dtype == torch.bfloat16 else t.dtype) for k, t in probe.items()}
    header, offset = {}, 0
    for k, (shape, dt) in spec.items():
        n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        header[PREFIX + k] = {"dtype": NAMES[dt], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(0)
    t0 = time.time()
    with open(a.out, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for k, (shape, dt) in spec.items():
            if k.endswith("rope.inv_freq"):
                n = shape[0]
                t = 1.0 / (10000.0 ** (torch.arange(n, dtype=torch.float64, device=device) / n))
            else:
                t = random_value(k, shape, gen, device)
            f.write(t.to(dt).contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    size = os.path.getsize(a.out)
    print(json.dumps({"out": a.out, "dtype": a.dtype, "layers": a.layers, "tensors": len(spec), "gib": size / 2**30,
                      "parameters": sum(torch.Size(s).numel() for s, _ in spec.values()), "seconds": time.time() - t0}))


if __name__ == "__main__":
    main()
