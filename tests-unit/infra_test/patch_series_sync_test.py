"""patches/ is in sync with this tree: what reviewers apply is exactly what we test here.

Needs no ComfyUI tree: it reads the generated .patch files. Every file a patch adds must be
byte-identical to this repository's file (content and git blob id), the only upstream files a patch
modifies are its diffs (hunk for hunk patches/upstream/<patch>/<path>.diff) and its edits, and every
file under comfy/, comfy_extras/ and tests-unit/ is added by exactly one patch unless series.json
excludes it with a reason (this test is excluded: it checks patches/, which exists only in this
repository). When a test here fails, run ``patches/build``.
"""

import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCHES = os.path.join(ROOT, "patches")
REBUILD = "rebuild the series: patches/build"

def _load_manifest_module():
    spec = importlib.util.spec_from_file_location("patches_manifest", os.path.join(PATCHES, "manifest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


edit_lines = _load_manifest_module().edit_lines if os.path.isfile(os.path.join(PATCHES, "manifest.py")) else None
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class FileDiff:
    path: str
    new_file: bool = False
    deleted: bool = False
    new_blob: str = ""
    binary: bool = False  # a GIT binary patch: only its blob id (the content's git hash) is checked
    hunks: list = field(default_factory=list)  # per hunk: (new_start, [(tag, text with its newline)])

    def post_image(self):
        """The new file's bytes when the hunks start at line 1 and cover it (new files, rewrites)."""
        if len(self.hunks) != 1 or self.hunks[0][0] not in (0, 1):
            return None
        return "".join(text for tag, text in self.hunks[0][1] if tag in " +").encode("utf-8")


@dataclass
class Patch:
    name: str
    headers: dict
    message: str
    files: list


def blob_id(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _parse_hunk(lines, i, old_count, new_count):
    body = []
    while old_count > 0 or new_count > 0:
        line = lines[i]
        tag, text = line[:1], line[1:] + "\n"
        if tag in " -":
            old_count -= 1
        if tag in " +":
            new_count -= 1
        if tag not in " +-":
            raise AssertionError(f"unexpected line in a hunk: {line!r}")
        i += 1
        if i < len(lines) and lines[i].startswith("\\ No newline at end of file"):
            text = text[:-1]
            i += 1
        body.append((tag, text))
    return body, i


def parse_files(lines, i, name):
    """The per-file diffs in `lines` from index i on (git's format: format-patch and git diff alike)."""
    files = []
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git a/"):
            files.append(FileDiff(path=line.split(" b/", 1)[1]))
        elif files and line.startswith("new file mode"):
            files[-1].new_file = True
        elif files and line.startswith("deleted file mode"):
            files[-1].deleted = True
        elif files and line.startswith("index "):
            files[-1].new_blob = line.split()[1].split("..")[1]
        elif files and line.startswith("GIT binary patch"):
            if not re.fullmatch(r"tests-unit/.+/data/[^/]+\.safetensors", files[-1].path):
                raise AssertionError(f"{name}: {files[-1].path} is a binary patch; only test data (tests-unit/**/data/"
                                     "*.safetensors) may be binary")
            files[-1].binary = True
            while i + 1 < len(lines) and not lines[i + 1].startswith("diff --git a/"):
                i += 1
        elif files and (m := HUNK.match(line)):
            old_count = int(m.group(2) if m.group(2) is not None else 1)
            new_count = int(m.group(4) if m.group(4) is not None else 1)
            body, i = _parse_hunk(lines, i + 1, old_count, new_count)
            files[-1].hunks.append((int(m.group(3)), body))
            continue
        i += 1
    return files


def parse_patch(name):
    """A format-patch file. Only Subject and the message are compared: From: and Date: name whoever
    built the series and when, which differ between builders."""
    with open(os.path.join(PATCHES, name), "rb") as f:
        lines = f.read().decode("utf-8").split("\n")
    end_of_headers = lines.index("")
    headers, key = {}, None
    for line in lines[1:end_of_headers]:
        if line[:1] in " \t":  # folded header
            headers[key] += " " + line.strip()
        else:
            key, _, value = line.partition(": ")
            headers[key] = value
    message_end = lines.index("---", end_of_headers)
    files = parse_files(lines, message_end, name)
    return Patch(name, headers, "\n".join(lines[end_of_headers + 1:message_end]).strip(), files)


def parse_diff(path):
    with open(path, "rb") as f:
        lines = f.read().decode("utf-8").split("\n")
    if not any(line.startswith("diff --git a/") for line in lines):  # a plain unified diff, as git apply takes
        target = next(line[len("+++ b/"):] for line in lines if line.startswith("+++ b/"))
        lines = [f"diff --git a/{target} b/{target}"] + lines
    files = parse_files(lines, 0, path)
    assert len(files) == 1, f"{path}: expected the diff of one file, found {len(files)}"
    return files[0]


@pytest.fixture(scope="module")
def manifest():
    with open(os.path.join(PATCHES, "series.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def patches():
    with open(os.path.join(PATCHES, "series"), encoding="utf-8") as f:
        names = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    return [parse_patch(n) for n in names]


def _repo_files(manifest):
    found = set()
    for top in manifest["covered_dirs"]:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            found.update(os.path.relpath(os.path.join(dirpath, n), ROOT).replace(os.sep, "/")
                         for n in filenames if not n.endswith(".pyc"))
    return found


def _read(path):
    with open(os.path.join(ROOT, path), "rb") as f:
        return f.read()


def test_series_is_the_manifest_in_order(manifest, patches):
    assert [p.name for p in patches] == [p["name"] + ".patch" for p in manifest["patches"]], REBUILD
    total = len(patches)
    for i, (patch, entry) in enumerate(zip(patches, manifest["patches"]), start=1):
        assert patch.headers["Subject"] == f"[PATCH {i}/{total}] {entry['subject']}", f"{patch.name}: {REBUILD}"
        with open(os.path.join(PATCHES, entry["message"]), encoding="utf-8") as f:
            body = f.read().strip()
        assert patch.message == body, f"{patch.name}: commit message differs from {entry['message']}; {REBUILD}"


def test_added_files_are_byte_identical_to_the_repository(patches):
    stale = []
    for patch in patches:
        for diff in patch.files:
            if not diff.new_file:
                continue
            path = os.path.join(ROOT, diff.path)
            if not os.path.isfile(path):
                stale.append(f"{patch.name} adds {diff.path}, which is not in this repository")
                continue
            data = _read(diff.path)
            if (not diff.binary and diff.post_image() != data) or diff.new_blob != blob_id(data):
                stale.append(f"{patch.name}: {diff.path} differs from the repository's file")
    assert not stale, "\n".join(stale + [REBUILD])


def test_modified_upstream_files_are_exactly_the_diffs_and_edits(manifest, patches):
    """Per patch: the upstream files it modifies are its diffs (hunk for hunk the stored .diff) and its
    edits (only the inserted lines, right after the anchor)."""
    for entry, patch in zip(manifest["patches"], patches):
        diffs = {path: os.path.join(PATCHES, "upstream", entry["name"], path + ".diff") for path in entry.get("diffs", [])}
        edits = {edit["path"]: edit for edit in entry.get("edits", [])}
        assert not set(diffs) & set(edits), f"{entry['name']}: a file is both a diff and an edit: {set(diffs) & set(edits)}"
        modified = {d.path: d for d in patch.files if not d.new_file}
        assert sorted(modified) == sorted(set(diffs) | set(edits)), f"{patch.name}: {REBUILD}"
        assert not any(d.deleted for d in modified.values())
        for path, stored in diffs.items():
            expected = parse_diff(stored)
            assert modified[path].hunks == expected.hunks, f"{patch.name}: {path} differs from {stored}; {REBUILD}"
        for path, spec in edits.items():
            diff = modified[path]
            anchor, insert = edit_lines(spec)
            changes = [(tag, text) for _, body in diff.hunks for tag, text in body if tag != " "]
            assert changes == [("+", line + "\n") for line in insert], f"{path}: expected only the added lines {insert!r}"
            body = diff.hunks[0][1]
            added = next(k for k, (tag, _) in enumerate(body) if tag == "+")
            assert body[added - 1] == (" ", anchor[-1] + "\n"), f"{path}: the added lines must follow {anchor!r}"


def test_every_repository_file_is_in_exactly_one_patch(manifest, patches):
    added = {}
    for patch in patches:
        for diff in patch.files:
            if diff.new_file:
                added.setdefault(diff.path, []).append(patch.name)
    files = _repo_files(manifest)
    excluded = manifest["excluded"]
    problems = [f"{f} is added by {len(added.get(f, []))} patches {added.get(f, [])}"
                for f in sorted(files) if f not in excluded and len(added.get(f, [])) != 1]
    problems += [f"{f} is excluded but a patch adds it" for f in sorted(excluded) if f in added]
    problems += [f"{f} is excluded but does not exist" for f in sorted(excluded) if f not in files]
    assert not problems, "\n".join(problems + [REBUILD])
    assert all(reason.strip() for reason in excluded.values()), "every exclusion needs a reason"
