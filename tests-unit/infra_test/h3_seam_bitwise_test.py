"""Patch 0001 changes no number: every case of minimax_h3_cases, run by the unpatched base tree and by
the patched tree (each in its own process, the same torch build), gives bit-identical outputs.

Runs from this repository with the trees scripts/test.sh builds (H3SP_BASE_TREE, H3SP_PATCHED_TREE).
"""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
CASES_DIR = os.path.join(os.path.dirname(HERE), "comfy_test")  # minimax_h3_cases.py, as the series adds it


def _outputs(tree, out):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, os.path.join(HERE, "h3_seam_outputs.py"), CASES_DIR, str(out)], cwd=tree, env=env,
                   check=True, timeout=600)
    return load_file(str(out))


def test_patched_forward_is_bit_identical_to_upstream(tmp_path):
    trees = [os.environ.get(k) for k in ("H3SP_BASE_TREE", "H3SP_PATCHED_TREE")]
    if not all(trees):
        pytest.skip("needs H3SP_BASE_TREE and H3SP_PATCHED_TREE (scripts/test.sh sets them)")
    base = _outputs(trees[0], tmp_path / "base.safetensors")
    patched = _outputs(trees[1], tmp_path / "patched.safetensors")
    assert sorted(base) == sorted(patched) and len(base) >= 40
    differ = [k for k in base if not torch.equal(base[k], patched[k])]
    assert not differ, f"patched outputs differ from upstream's: {differ}"
