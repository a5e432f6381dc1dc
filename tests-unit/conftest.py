"""Shared fixtures for the project's tests.

* ``COMFYUI_DIR``: when set to a checkout of the pinned ComfyUI base, it is appended to
  ``sys.path`` so that ``comfy`` (a namespace package, as upstream) merges this repository's modules
  with ComfyUI's. Tests marked ``comfyui`` use the ``comfyui_dir`` fixture and skip without it.
* ``run_ranks``: run a module-level function on N spawned processes with a gloo group.
"""

import importlib.util
import os
import sys

import pytest

from rank_runner import free_port as _free_port
from rank_runner import run_ranks as _run_ranks

COMFYUI_DIR = os.environ.get("COMFYUI_DIR") or None
if COMFYUI_DIR:
    COMFYUI_DIR = os.path.abspath(COMFYUI_DIR)
    if COMFYUI_DIR not in sys.path:
        sys.path.append(COMFYUI_DIR)


def comfyui_available():
    """ComfyUI importable: an overlay (COMFYUI_DIR) or these files inside a (patched) ComfyUI tree."""
    return importlib.util.find_spec("comfy.model_patcher") is not None


if comfyui_available():
    import absent_media_packages
    import torch
    # comfy.model_base imports torchvision / torchaudio at module level; stand-ins where they are absent
    absent_media_packages.install()
    if not torch.cuda.is_available():
        # before anything imports comfy.model_management, which asserts CUDA unless told otherwise
        from comfy.cli_args import args as _comfy_args
        _comfy_args.cpu = True


@pytest.fixture
def comfyui_dir():
    """The ComfyUI tree the tests run against; skips when there is none."""
    if not comfyui_available():
        pytest.skip("ComfyUI is not importable: set COMFYUI_DIR to a checkout of ComfyUI 0f1fa67 "
                    "(see README, 'Tests against ComfyUI') to run the overlay tests")
    return os.path.dirname(os.path.dirname(os.path.abspath(importlib.util.find_spec("comfy.model_patcher").origin)))


@pytest.fixture
def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return _free_port()


@pytest.fixture
def run_ranks():
    """``run_ranks(fn, world, kwargs=None, timeout=60.0, process_group=True)`` -> list of rank results."""
    return _run_ranks


@pytest.fixture(scope="session")
def _media_stub_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media_stub")
    (d / "sitecustomize.py").write_text("import absent_media_packages\nabsent_media_packages.install()\n")
    return str(d)


@pytest.fixture
def comfyui_models(comfyui_dir, _media_stub_dir, monkeypatch):
    """ComfyUI's model stack (model_base, model_patcher, lora, sd) importable here and in the worker
    processes tests spawn (they inherit sys.path, so they run the stub's sitecustomize)."""
    import absent_media_packages
    absent_media_packages.install()
    monkeypatch.syspath_prepend(_media_stub_dir)
    import comfy.lora  # noqa: F401
    import comfy.model_patcher  # noqa: F401
    import comfy.sd  # noqa: F401
    return comfyui_dir


REEXPORT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patches", "overlay")


@pytest.fixture(scope="session")
def _patched_stub_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("patched_stub")
    (d / "sitecustomize.py").write_text("import sys\nimport absent_media_packages\nabsent_media_packages.install()\n"
                                        f"sys.path.insert(0, {REEXPORT_DIR!r})\n")
    return str(d)


@pytest.fixture
def comfyui_patched(comfyui_models, _patched_stub_dir, monkeypatch):
    """As in a tree with the patch series applied: ComfyUI's comfy.ldm.minimax.model is the re-export
    of this package, here (module swapped) and in every worker process (re-export first on sys.path)."""
    import comfy.ldm.minimax
    import comfy.ldm.minimax.model as current
    from comfy.ldm.minimax_h3.model import MiniMaxH3Model
    if current.MiniMaxH3Model is MiniMaxH3Model:
        return comfyui_models  # a patched tree
    spec = importlib.util.spec_from_file_location("comfy.ldm.minimax.model", os.path.join(REEXPORT_DIR, "comfy", "ldm", "minimax", "model.py"))
    reexport = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "comfy.ldm.minimax.model", reexport)  # before it runs, as an import does
    spec.loader.exec_module(reexport)
    monkeypatch.setattr(comfy.ldm.minimax, "model", reexport, raising=False)
    monkeypatch.syspath_prepend(_patched_stub_dir)
    return comfyui_models
