"""The README's main job (scripts/run_main.sh on its defaults: a small generated H3 checkpoint through a
real ComfyUI workflow, 2 CPU ranks) passes, from its own patched tree. The job checks parity with the
workflow without the node, that ComfyUI's unload keeps the workers, and that freeing the model ends them."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sharded runs need Linux")
def test_the_main_job_passes(tmp_path):
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "run_main.sh"), "--python", sys.executable,
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert "-> PASS" in proc.stdout, tail
    with open(tmp_path / "h3_sequence_parallel.json") as f:  # written once the verdict is known
        result = json.load(f)
    assert result["parity"] is True and result["workers_kept_on_unload"] is True and result["workers_closed_when_freed"] is True
