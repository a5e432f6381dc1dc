"""The generated tables in README.md and bench/README.md match bench/results/*.json and bench/peers.json,
and every results file is indexed (bench/tables.py --check, in-process).

Needs no GPU and no plotting package: the tables come from the stored JSON only. When this test fails,
run ``python bench/tables.py`` and commit the result.
"""

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "tables.py"
RFC = ROOT / "rfc" / "0000-minimax-h3-sequence-parallel.md"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason="bench/tables.py not in this tree (tests run inside a patched ComfyUI)")


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("bench_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def captions(text):
    return re.findall(r"^\*\*(.+?)\*\*", text, re.M)


def test_readme_and_bench_readme_in_sync(tables, capsys):
    for doc in (tables.README, tables.BENCH_README):
        if not doc.is_file() or tables.BEGIN not in doc.read_text(encoding="utf-8"):
            pytest.skip(f"{doc.name} or its table markers are absent in this tree")
    rc = tables.main(["--check"])
    assert rc == 0, "generated tables are out of date or bench/results is not indexed; run python bench/tables.py\n" + capsys.readouterr().out


def test_check_fails_on_a_hand_edited_number(tables, tmp_path, monkeypatch, capsys):
    # copies of both READMEs and of the results, in sync; then one digit of the README's generated block changed by hand
    results = tmp_path / "bench" / "results"
    shutil.copytree(tables.RESULTS, results, ignore=shutil.ignore_patterns("archive"))
    for name, doc in (("README", tables.README), ("BENCH_README", tables.BENCH_README)):
        copy = tmp_path / doc.relative_to(ROOT)
        shutil.copyfile(doc, copy)
        monkeypatch.setattr(tables, name, copy)
    assert tables.main(["--check", "--results", str(results)]) == 0
    text = tables.README.read_text(encoding="utf-8")
    block = tables.current_block(text)
    edited = re.sub(r"\d\.\d\d", lambda m: m.group(0)[:-1] + str((int(m.group(0)[-1]) + 1) % 10), block, count=1)
    assert edited != block
    tables.README.write_text(text.replace(block, edited), encoding="utf-8")
    capsys.readouterr()
    assert tables.main(["--check", "--results", str(results)]) == 1
    assert "out of date" in capsys.readouterr().out


def test_each_target_gets_its_own_set(tables):
    readme, bench, rfc = (tables.generate(tables.RESULTS, tables.tables_for(doc)) for doc in (tables.README, tables.BENCH_README, RFC))
    caps = [captions(t) for t in (readme, bench, rfc)]
    assert len(caps[0]) == 3  # the README: the emulated scaling, the peers and the series' size, nothing else
    assert "Sequence-parallel scaling" in caps[0][0] and "Side by side with the peers" in caps[0][1]
    assert "The series' size" in caps[0][2] and "The series' size" in caps[2][-1]
    assert "Results index." in caps[1] and "Results index." not in caps[2]
    assert len(caps[0]) < len(caps[2]) < len(caps[1])
    for text in (readme, bench, rfc):
        assert "table skipped" not in text
        assert "archive" not in text  # superseded runs are in no table
        assert not re.search(r"targets? (is |are )?met|meets? the targets?|\|\s*met\b", text, re.I)
        # every table built from the emulation says so in its caption
        for line in re.findall(r"^\*\*.+$", text, re.M):
            if tables.EMULATION_JSON in line:
                assert "EMULATED" in captions(line)[0], line


def test_index_names_every_results_file(tables, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(tables.RESULTS, results, ignore=shutil.ignore_patterns("archive"))
    assert tables.index_problems(results) == []
    (results / "h3_h200_new_run.json").write_text("{}", encoding="utf-8")
    (results / tables.SHARED_JSON).unlink()
    problems = tables.index_problems(results)
    assert len(problems) == 2
    assert "h3_h200_new_run.json is not in" in problems[0] and f"names {tables.SHARED_JSON}, which is not in" in problems[1]
    # a glob that matches nothing (a run that may come back) is neither a problem nor a row; once it matches it is a row
    (results / "patch_check.json").unlink(missing_ok=True)
    rows = tables.t_index(results)
    assert not any("patch_check" in line for line in rows)
    (results / "patch_check.json").write_text("{}", encoding="utf-8")
    assert [line for line in tables.t_index(results) if "`patch_check.json`" in line]
    assert not any("patch_check.json" in p for p in tables.index_problems(results))


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
    (tmp_path / tables.EMULATION_JSON).write_text('{"gpu": "X", "cases": {"38k": {"tokens": 1}}}', encoding="utf-8")
    (tmp_path / tables.SHARED_JSON).write_text('{"gpu": "X", "runs": [{"ranks": 2}]}', encoding="utf-8")
    block = tables.generate(tmp_path)
    assert "sequence-parallel scaling: table skipped" in block
    assert "side by side with the peers: table skipped" in block
    assert "users' GPUs: table skipped" in block
    assert "**The data paths for real" in block  # a run without numbers: a row of dashes, not a crash


def test_the_series_size_counts_added_non_blank_lines_by_file(tables, tmp_path):
    patch = tmp_path / "0001-x.patch"
    patch.write_text("From x\nSubject: x\n---\ndiff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1 +1,3 @@\n+x = 1\n+\n"
                     "-y = 2\n+   \n+z = 3\ndiff --git a/tests-unit/t.py b/tests-unit/t.py\n+++ b/tests-unit/t.py\n+assert 1\n",
                     encoding="utf-8")
    assert tables.patch_lines(patch) == {"a.py": 2, "tests-unit/t.py": 1}
