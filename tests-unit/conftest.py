"""Shared fixtures for the project's tests.

* ``COMFYUI_DIR``: when set to a checkout of the pinned ComfyUI base, it is appended to
  ``sys.path`` so that ``comfy`` (a namespace package, as upstream) merges this repository's modules
  with ComfyUI's. Tests marked ``comfyui`` use the ``comfyui_dir`` fixture and skip without it.
* Nothing here changes ComfyUI's settings: test modules that import ComfyUI's model code set
  ``args.cpu`` themselves on a machine without CUDA, as ComfyUI's own tests do.
* ``run_ranks``: run a module-level function on N processes (forked from a rank server that the
  session ends) with a gloo group.
"""

import importlib.util
import os
import sys

import pytest

from rank_runner import close_servers as _close_rank_servers
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


@pytest.fixture(scope="session")
def comfyui_dir():
    """The ComfyUI tree the tests run against; skips when there is none."""
    if not comfyui_available():
        pytest.skip("ComfyUI is not importable: set COMFYUI_DIR to a checkout of ComfyUI 0f1fa67 "
                    "(see README, 'Tests against ComfyUI') to run the overlay tests")
    return os.path.dirname(os.path.dirname(os.path.abspath(importlib.util.find_spec("comfy.model_patcher").origin)))


@pytest.fixture
def linux_workers():
    """comfy.parallel's worker processes need Linux (inherited pipe fds, /proc); skips elsewhere."""
    if not sys.platform.startswith("linux"):
        pytest.skip(f"comfy.parallel runs worker processes on Linux only (this is {sys.platform})")


@pytest.fixture
def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return _free_port()


@pytest.fixture(scope="session")
def _rank_servers():
    yield
    _close_rank_servers()


@pytest.fixture
def run_ranks(_rank_servers):
    """``run_ranks(fn, world, kwargs=None, timeout=60.0, process_group=True)`` -> list of rank results."""
    return _run_ranks


@pytest.fixture(scope="session")
def comfyui_models(comfyui_dir):
    """ComfyUI's model stack (model_base, model_patcher, lora, sd) imported."""
    import comfy.lora  # noqa: F401
    import comfy.model_patcher  # noqa: F401
    import comfy.sd  # noqa: F401
    return comfyui_dir


REEXPORT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patches", "overlay")


def _as_in_a_patched_tree(monkeypatch):
    """ComfyUI's comfy.ldm.minimax.model becomes the re-export of this package, here (module swapped)
    and in every worker process (the re-export's folder first on sys.path, which workers inherit in
    order); nothing to do in a tree with the patch series applied."""
    import comfy.ldm.minimax
    import comfy.ldm.minimax.model as current
    from comfy.ldm.minimax_h3.model import MiniMaxH3Model
    if current.MiniMaxH3Model is MiniMaxH3Model:
        return
    spec = importlib.util.spec_from_file_location("comfy.ldm.minimax.model", os.path.join(REEXPORT_DIR, "comfy", "ldm", "minimax", "model.py"))
    reexport = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "comfy.ldm.minimax.model", reexport)  # before it runs, as an import does
    spec.loader.exec_module(reexport)
    monkeypatch.setattr(comfy.ldm.minimax, "model", reexport, raising=False)
    monkeypatch.syspath_prepend(REEXPORT_DIR)


@pytest.fixture
def comfyui_patched(comfyui_models, monkeypatch):
    """As in a tree with the patch series applied (see ``_as_in_a_patched_tree``), for one test."""
    _as_in_a_patched_tree(monkeypatch)
    return comfyui_models


@pytest.fixture(scope="module")
def comfyui_patched_module(comfyui_models):
    """``comfyui_patched`` for a module's tests, for fixtures that share one worker group among them."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _as_in_a_patched_tree(monkeypatch)
        yield comfyui_models
