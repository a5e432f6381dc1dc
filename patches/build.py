"""Build the patch series from this repository against the base tree (comfyui-h3-newest).

    patches/build                       write patches/NNNN-name.patch and patches/series
    patches/build --tree DIR            only make DIR = the base + the series (what the tests run in)
    patches/build --diff PATCH PATH NEW write patches/upstream/PATCH/PATH.diff: NEW against PATH as the
                                        earlier patches leave it (how an upstream file's edit is stored)

The base is COMFYUI_DIR, else .comfyui/comfyui-h3-newest (scripts/comfyui_tree.sh makes it). Both
modes run the same steps per patch, in series.json order (manifest.apply_patch): copy its files, `git
apply` its diffs, make its edits. Building the series commits each patch in a clone of the base, with
the builder's identity (H3SP_AUTHOR or git config) and series.json's date, and `git format-patch`
writes the files; stale .patch files are removed. Same tree, base and author: identical bytes.
"""

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile

import manifest as series
from manifest import HERE, REPO, SeriesError, git

FORMAT_PATCH = ["format-patch", "--no-signature", "--zero-commit", "--full-index", "--numbered", "--no-renames",
                "--stat=80"]


def commit(tree, manifest, patch):
    with open(os.path.join(HERE, patch["message"]), encoding="utf-8") as f:
        body = f.read().strip()
    message = os.path.join(tree, ".git", "PATCH_MESSAGE")
    with open(message, "w", encoding="utf-8", newline="\n") as f:
        f.write(f"{patch['subject']}\n\n{body}\n")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "--cleanup=whitespace", "-F", message, env=series.identity(manifest))
    try:
        git(tree, "diff", "--check", "HEAD~1", "HEAD")  # git am's own whitespace rules, on the whole commit
    except SeriesError as e:
        raise SeriesError(f"{patch['name']} has whitespace errors git am would warn about:\n{e}") from None
    return git(tree, "diff", "--shortstat", "HEAD~1", "HEAD").strip()


def write_if_changed(path, data):
    if os.path.exists(path):
        with open(path, "rb") as f:
            if f.read() == data:
                return False
    with open(path, "wb") as f:
        f.write(data)
    return True


def check_subjects(manifest):
    long = [p["subject"] for p in manifest["patches"] if len(p["subject"]) > 72]
    if long:
        raise SeriesError("subjects over 72 characters (ComfyUI style: 'Add ...', 'Support ...'): " + "; ".join(long))


def build_series(manifest, base_dir, work):
    resolved = series.resolve_strict(manifest)
    check_subjects(manifest)
    tree = os.path.join(work, "tree")
    series.clone(base_dir, tree)
    series.verify_base(manifest, tree, label=base_dir)
    base = git(tree, "rev-parse", "HEAD").strip()
    stats = []
    for patch in manifest["patches"]:
        series.apply_patch(tree, patch, resolved[patch["name"]])
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
        print(f"{name:42s} {len(data):8d} bytes  {stat}{'' if changed else '  (unchanged)'}")
    write_if_changed(os.path.join(HERE, "series"), "".join(n + "\n" for n in names).encode("utf-8"))
    print(f"series: {len(names)} patches; excluded from the series: {', '.join(sorted(manifest['excluded'])) or 'nothing'}")


def written(patch):
    """The patch without the diffs not written yet (warned about): the rest of the series still gets tested."""
    return dict(patch, diffs=[d for d in patch.get("diffs", []) if os.path.isfile(series.diff_file(patch, d))])


def build_tree(manifest, base_dir, dest, upto=None):
    """dest = the base + the series (up to, not including, patch `upto`); returns ["lint PATH" for each
    upstream file the series edits, "test PATH" for each test file it adds], for scripts/test.sh."""
    resolved, problems = series.resolve(manifest)
    for problem in problems:
        print(f"patches/build --tree: warning: {problem}", file=sys.stderr)
    series.verify_base(manifest, base_dir)
    series.sync_tree(base_dir, dest)
    touched = []
    for patch in manifest["patches"]:
        if patch["name"] == upto:
            break
        series.apply_patch(dest, written(patch), resolved[patch["name"]])
        touched += [f"lint {p}" for p in patch.get("diffs", []) + [e["path"] for e in patch.get("edits", [])]]
        touched += [f"test {p}" for p in resolved[patch["name"]] if is_test(p)]
    return sorted(set(touched))


def is_test(path):
    name = path.rsplit("/", 1)[-1]
    return path.startswith("tests-unit/") and name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def make_diff(manifest, base_dir, name, path, new, work):
    """Write patches/upstream/<name>/<path>.diff: `new` against `path` after the patches before `name`."""
    entry = next((p for p in manifest["patches"] if p["name"] == name), None)
    if entry is None:
        raise SeriesError(f"no patch {name!r} in series.json: one of {', '.join(p['name'] for p in manifest['patches'])}")
    tree = os.path.join(work, "tree")
    build_tree(manifest, base_dir, tree, upto=name)
    resolved, _ = series.resolve(manifest)
    series.apply_patch(tree, written(entry), resolved[name], upto_diff=path)
    for side, source in (("a", os.path.join(tree, path)), ("b", os.path.abspath(new))):
        os.makedirs(os.path.dirname(os.path.join(work, side, path)), exist_ok=True)
        shutil.copyfile(source, os.path.join(work, side, path))
    diff = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "--full-index", "--", f"a/{path}", f"b/{path}"],
                          cwd=work, capture_output=True, text=True,
                          env=dict(os.environ, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, LC_ALL="C"))
    if diff.returncode not in (0, 1):
        raise SeriesError(f"git diff failed: {diff.stderr}")
    if not diff.stdout:
        raise SeriesError(f"{new} is the same as {path} after the earlier patches: nothing to store")
    out = series.diff_file(entry, path)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        f.write(diff.stdout)
    if path not in entry.get("diffs", []):
        print(f"now list {path!r} in {name}'s \"diffs\" in patches/series.json")
    print(f"wrote {os.path.relpath(out, REPO)}: {diff.stdout.count(chr(10) + '@@')} hunks")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", metavar="DIR", help="only build DIR = the base + the series (no commits, no .patch files)")
    ap.add_argument("--diff", nargs=3, metavar=("PATCH", "PATH", "NEW"), help="store NEW as PATCH's diff of upstream PATH")
    a = ap.parse_args()
    try:
        manifest = series.load()
        base_dir = series.comfyui_dir()
        if a.tree:
            for line in build_tree(manifest, base_dir, os.path.abspath(a.tree)):
                print(line)
            return 0
        with tempfile.TemporaryDirectory(prefix="h3sp-build-") as work:
            if a.diff:
                make_diff(manifest, base_dir, *a.diff, work)
            else:
                build_series(manifest, base_dir, work)
    except SeriesError as e:
        print(f"patches/build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
