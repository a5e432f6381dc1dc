"""Regenerate the patch series from this repository against the pinned ComfyUI base.

    COMFYUI_DIR=/path/to/ComfyUI patches/build

Clones COMFYUI_DIR (its committed content), checks that it is the pinned base, and for each patch
in series.json, in order, copies the patch's files from this repository, applies its replacements
and line edits, and commits with a fixed author and date. `git format-patch` then writes
patches/NNNN-name.patch for every commit and patches/series lists them in order; stale .patch
files are removed. The output depends only on this tree and the base: two runs give identical bytes.
"""

import glob
import os
import shutil
import sys
import tempfile

import manifest as series
from manifest import HERE, REPO, SeriesError, edit_lines, git

FORMAT_PATCH = ["format-patch", "--no-signature", "--zero-commit", "--full-index", "--numbered", "--no-renames",
                "--break-rewrites", "--stat=80"]


def copy_file(source, tree, path):
    dest = os.path.join(tree, path)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copyfile(source, dest)
    shutil.copymode(source, dest)


def add_files(tree, patch, files):
    for path in files:
        if os.path.exists(os.path.join(tree, path)):
            raise SeriesError(f"{patch['name']}: {path} already exists in the base (or an earlier patch); "
                              "a patch changes upstream files only through 'replace' or 'edits'")
        copy_file(os.path.join(REPO, path), tree, path)
    for target, source in sorted(patch.get("replace", {}).items()):
        if not os.path.isfile(os.path.join(tree, target)):
            raise SeriesError(f"{patch['name']}: 'replace' target {target} is not in the base")
        copy_file(os.path.join(REPO, source), tree, target)


def apply_edit(tree, patch, edit):
    """Insert `insert_line` right after the one run of lines equal to `after_line`; anything else is an error."""
    path = os.path.join(tree, edit["path"])
    with open(path, "rb") as f:
        lines = f.read().decode("utf-8").splitlines(keepends=True)
    anchor, insert = edit_lines(edit)
    bare = [line.rstrip("\r\n") for line in lines]
    hits = [i for i in range(len(bare) - len(anchor) + 1) if bare[i:i + len(anchor)] == anchor]
    if len(hits) != 1:
        raise SeriesError(f"{patch['name']}: edit of {edit['path']}: expected exactly one run of lines {anchor!r}, "
                          f"found {len(hits)}; the base changed, update the edit in patches/series.json")
    last = hits[0] + len(anchor) - 1
    if bare[last + 1:last + 1 + len(insert)] == insert:
        raise SeriesError(f"{patch['name']}: edit of {edit['path']}: {insert!r} is already there")
    ending = lines[last][len(anchor[-1]):] or "\n"
    lines[last + 1:last + 1] = [line + ending for line in insert]
    with open(path, "wb") as f:
        f.write("".join(lines).encode("utf-8"))


def commit(tree, manifest, patch):
    with open(os.path.join(HERE, patch["message"]), encoding="utf-8") as f:
        body = f.read().strip()
    message = os.path.join(tree, ".git", "PATCH_MESSAGE")
    with open(message, "w", encoding="utf-8", newline="\n") as f:
        f.write(f"{patch['subject']}\n\n{body}\n")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "--cleanup=whitespace", "-F", message, env=series.identity(manifest))
    stat = git(tree, "diff", "--shortstat", "HEAD~1", "HEAD").strip()
    return stat


def write_if_changed(path, data):
    if os.path.exists(path):
        with open(path, "rb") as f:
            if f.read() == data:
                return False
    with open(path, "wb") as f:
        f.write(data)
    return True


def build(manifest, base_dir, work):
    resolved = series.resolve(manifest)
    tree = os.path.join(work, "tree")
    series.clone(base_dir, tree)
    series.verify_base(manifest, tree, label=base_dir)
    base = git(tree, "rev-parse", "HEAD").strip()
    stats = []
    for patch in manifest["patches"]:
        add_files(tree, patch, resolved[patch["name"]])
        for edit in patch.get("edits", []):
            apply_edit(tree, patch, edit)
        stats.append(commit(tree, manifest, patch))

    out = os.path.join(work, "out")
    git(tree, *FORMAT_PATCH, "-o", out, f"{base}..HEAD")
    produced = sorted(os.listdir(out))
    if len(produced) != len(manifest["patches"]):
        raise SeriesError(f"git format-patch wrote {len(produced)} patches for {len(manifest['patches'])} commits")

    names = [p["name"] + ".patch" for p in manifest["patches"]]
    for stale in sorted(set(map(os.path.basename, glob.glob(os.path.join(HERE, "*.patch")))) - set(names)):
        os.remove(os.path.join(HERE, stale))
        print(f"removed stale {stale}")
    for patch, name, produced_name, stat in zip(manifest["patches"], names, produced, stats):
        with open(os.path.join(out, produced_name), "rb") as f:
            data = f.read()
        changed = write_if_changed(os.path.join(HERE, name), data)
        print(f"{name:45s} {len(resolved[patch['name']]) + len(patch.get('replace', {})) + len(patch.get('edits', [])):3d} files "
              f"{len(data):8d} bytes  {stat}{'' if changed else '  (unchanged)'}")
    write_if_changed(os.path.join(HERE, "series"), "".join(n + "\n" for n in names).encode("utf-8"))
    excluded = manifest["excluded"]
    print(f"series: {len(names)} patches; excluded from the series: {', '.join(sorted(excluded)) or 'nothing'}")


def main():
    try:
        manifest = series.load()
        base_dir = series.comfyui_dir()
        with tempfile.TemporaryDirectory(prefix="h3sp-build-") as work:
            build(manifest, base_dir, work)
    except SeriesError as e:
        print(f"patches/build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
