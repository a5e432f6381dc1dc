"""patches/manifest.py's tree steps: a diff lands in the tree even when the tree lies inside another
git repository (.comfyui/ is inside this one), the rebuild starts clean, and what git am would warn
about is refused up front."""

import importlib.util
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def manifest(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("patches_manifest_steps", os.path.join(ROOT, "patches", "manifest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "REPO", str(tmp_path / "repo"))
    monkeypatch.setattr(module, "UPSTREAM", str(tmp_path / "repo" / "patches" / "upstream"))
    return module


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="\n") as f:
        f.write(text)


def test_diff_applies_to_a_tree_nested_in_another_repository(manifest, tmp_path):
    outer = tmp_path / "outer"
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    tree = outer / "tree"
    write(str(tree / "a.py"), "x = 1\n")
    write(str(tmp_path / "repo" / "patches" / "upstream" / "p" / "a.py.diff"),
          "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n")
    manifest.apply_patch(str(tree), {"name": "p", "diffs": ["a.py"]}, [])
    assert (tree / "a.py").read_text() == "x = 2\n"
    assert not (outer / "a.py").exists()


def test_rebuild_removes_leftovers_and_keeps_bytecode(manifest, tmp_path):
    base, tree = tmp_path / "base", tmp_path / "tree"
    write(str(base / "pkg" / "m.py"), "y = 1\n")
    manifest.sync_tree(str(base), str(tree))
    write(str(tree / "pkg" / "__pycache__" / "m.cpython-311.pyc"), "")
    write(str(tree / "temp" / "comfy-parallel-x" / "rank1.log"), "left by a test\n")
    write(str(tree / "pkg" / "m.py"), "y = 2\n")
    manifest.sync_tree(str(base), str(tree))
    assert (tree / "pkg" / "m.py").read_text() == "y = 1\n"
    assert not (tree / "temp").exists()
    assert (tree / "pkg" / "__pycache__" / "m.cpython-311.pyc").exists()


@pytest.mark.parametrize("text", ["x = 1\n\n", "x = 1 \n"])
def test_added_file_with_whitespace_git_am_warns_about_is_refused(manifest, tmp_path, text):
    write(str(tmp_path / "repo" / "comfy" / "new.py"), text)
    with pytest.raises(manifest.SeriesError, match="git am would warn"):
        manifest.apply_patch(str(tmp_path / "tree"), {"name": "p"}, ["comfy/new.py"])
