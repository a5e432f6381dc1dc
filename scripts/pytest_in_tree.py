"""pytest inside a ComfyUI tree (the current directory), on the CPU when there is no CUDA.

Upstream's tests do not pass --cpu (its CI machines import CUDA torch builds that fall back by
themselves); on a CPU-only torch, comfy.model_management needs args.cpu set before it is imported.
Setting it here, before pytest imports any test, keeps that out of the test folders.
Worker processes that the tests start get rank 0's args, --cpu included.
"""

import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

if not torch.cuda.is_available():
    from comfy.cli_args import args
    args.cpu = True

import pytest  # noqa: E402

sys.exit(pytest.main(sys.argv[1:]))
