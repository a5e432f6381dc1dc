"""Before this folder's modules import ComfyUI's model code: ComfyUI's CPU mode on a machine without
CUDA, as ComfyUI's own tests set it (comfy.model_management asserts CUDA otherwise). The newer-upstream
reference outputs, loaded once for every test that compares with them."""

import pytest
import torch

from comfy.cli_args import args

if not torch.cuda.is_available():
    args.cpu = True


@pytest.fixture(scope="session")
def reference():
    """The newer upstream's stored outputs: (tensors, manifest) of ``data/upstream_newer_reference.safetensors``."""
    import upstream_newer
    return upstream_newer.load_reference()


@pytest.fixture(scope="session")
def edges():
    """The stored outputs of the edge denoise masks: (tensors, manifest) of ``data/mask_edges_reference.safetensors``."""
    import mask_edges
    return mask_edges.load_reference()
