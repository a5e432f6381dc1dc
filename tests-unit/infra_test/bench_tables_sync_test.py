"""README.md's generated tables match bench/results/*.json (bench/tables.py --check, in-process).

Needs neither matplotlib nor a GPU: the tables come from the stored JSON only. When this test fails,
run ``python bench/tables.py`` (add ``--plots`` when matplotlib is installed) and commit the result.
"""

import builtins
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "tables.py"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason="bench/tables.py not in this tree (tests run inside a patched ComfyUI)")


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("bench_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_matplotlib(monkeypatch):
    """Any import of matplotlib fails, as on a CI machine without it."""
    real_import = builtins.__import__

    def guarded(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("matplotlib blocked by the test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", guarded)


def test_readme_tables_in_sync(tables, no_matplotlib, capsys):
    readme = tables.README
    if not readme.is_file() or tables.BEGIN not in readme.read_text(encoding="utf-8"):
        pytest.skip("README.md or its table markers are absent in this tree")
    rc = tables.main(["--check"])
    assert rc == 0, "README.md's generated tables are out of date; run python bench/tables.py\n" + capsys.readouterr().out


def test_splice_keeps_the_rest_byte_identical(tables, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    doc = tmp_path / "doc.md"
    head, tail = "# T\r\n\ntext  \n", "\n\nafter\n\t end"
    doc.write_bytes((head + tables.BEGIN + "\nold stuff\n" + tables.END + tail).encode())
    assert tables.write_into(doc, results) == "changed"
    text = doc.read_bytes().decode()
    assert text.startswith(head + tables.BEGIN) and text.endswith(tables.END + tail)
    assert "old stuff" not in text
    # no JSON at all: every table is a comment line, nothing crashes, and a second run is a no-op
    assert "table skipped" in text
    assert tables.write_into(doc, results, check=True) == "ok"


def test_missing_file_or_markers_are_skipped(tables, tmp_path):
    assert tables.write_into(tmp_path / "absent.md", tmp_path) == "skipped"
    plain = tmp_path / "plain.md"
    plain.write_text("no markers here\n", encoding="utf-8")
    assert tables.write_into(plain, tmp_path) == "skipped"
    assert plain.read_text(encoding="utf-8") == "no markers here\n"


def test_partial_json_skips_a_table_not_the_run(tables, tmp_path):
    (tmp_path / tables.H3_JSON).write_text('{"machine": {"gpu": "X"}, "native": {"r": {"tokens": 1}}}', encoding="utf-8")
    block = tables.generate(tmp_path, tmp_path)
    assert "H3 native forward: table skipped" in block
    assert "sequence-parallel scaling: table skipped" in block

