"""The package's versioned extension interface is code: ``__all__``, lazily imported names and the
runner Protocol that ``MiniMaxH3Model.run`` relies on."""

import importlib
import os
import subprocess
import sys

import pytest

import comfy.ldm.minimax_h3 as h3

# where each versioned name is defined (the package must hand out that very object)
HOMES = {
    "MiniMaxH3Model": "model", "SEQUENCE_PARALLEL_OPTION": "model", "StepInputs": "step_io", "ForwardPlan": "plan", "ShardPlan": "plan",
    "PackedLayout": "layout", "TimestepPlan": "conditioning", "text_tag_runs": "conditioning",
    "mod_segments": "conditioning", "curve_t_emb": "conditioning", "clip_segments": "modulation",
    "mod_scale_shift": "modulation", "mod_gate": "modulation", "norm_scale_shift": "modulation",
}


def test_every_versioned_name_is_the_defining_modules_object():
    assert sorted(h3.__all__) == sorted(["H3_EXTENSION_API", "SequenceParallelRunner", *HOMES])
    for name, home in HOMES.items():
        assert getattr(h3, name) is getattr(importlib.import_module(f"comfy.ldm.minimax_h3.{home}"), name), name
    assert h3.H3_EXTENSION_API == (1, 0)
    with pytest.raises(AttributeError, match="has no attribute 'run_sharded'"):
        h3.run_sharded


def test_importing_the_package_imports_no_model_code():
    code = ("import sys; import comfy.ldm.minimax_h3 as h3; "
            "print(sorted(m for m in sys.modules if m.startswith('comfy.ldm.minimax_h3.') or m == 'torch'))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=env)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
