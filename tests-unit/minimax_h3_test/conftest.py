"""Before this folder's modules import ComfyUI's model code: ComfyUI's CPU mode on a machine without
CUDA, as ComfyUI's own tests set it (comfy.model_management asserts CUDA otherwise)."""

import torch

from comfy.cli_args import args

if not torch.cuda.is_available():
    args.cpu = True
