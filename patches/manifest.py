"""The patch series manifest (series.json) and the steps build and check share.

series.json names, in order, each patch's subject, message file and what it changes:
  files  repository files it adds at the same path in ComfyUI (globs allowed in the last part);
  diffs  upstream files it edits: the unified diff patches/upstream/<patch>/<path>.diff, made against
         the file as it is after the earlier patches (`build.py --diff` writes one);
  edits  line insertions into upstream files (an anchor run of lines, the lines to insert after it).
Every file under the covered directories must belong to exactly one patch or be excluded with a
reason, and every .diff under patches/upstream/ must be listed, so that the series never silently
misses a file.
"""

import fnmatch
import hashlib
import json
import os
import shutil
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MANIFEST = os.path.join(HERE, "series.json")
UPSTREAM = os.path.join(HERE, "upstream")
DEFAULT_BASE = os.path.join(REPO, ".comfyui", "comfyui-h3-newest")


class SeriesError(Exception):
    pass


def load():
    with open(MANIFEST, encoding="utf-8") as f:
        return json.load(f)


def repo_files(manifest):
    """Files under the covered directories, repository-relative, '/'-separated, sorted."""
    found = []
    for top in manifest["covered_dirs"]:
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in filenames:
                if not name.endswith(".pyc"):
                    found.append(os.path.relpath(os.path.join(dirpath, name), REPO).replace(os.sep, "/"))
    return sorted(found)


def read_text(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def diff_file(patch, path):
    return os.path.join(UPSTREAM, patch["name"], path + ".diff")


def resolve(manifest):
    """({patch name: sorted file list}, [problems]): problems name unclaimed or doubly claimed files,
    patterns that match nothing, and missing or unlisted diffs. build and check refuse any problem;
    the test tree (build.py --tree) only warns, so a half-done edit of series.json can still be tested."""
    files = repo_files(manifest)
    owners = {f: [] for f in files}
    resolved, problems = {}, []
    for patch in manifest["patches"]:
        chosen = []
        for pattern in patch.get("files", []):
            folder, leaf = pattern.rsplit("/", 1)
            matches = [f for f in files if f.rsplit("/", 1)[0] == folder and fnmatch.fnmatchcase(f.rsplit("/", 1)[1], leaf)]
            if not matches:
                problems.append(f"{patch['name']}: '{pattern}' matches no file in the repository")
            chosen.extend(m for m in matches if m not in chosen)
        for f in chosen:
            owners[f].append(patch["name"])
        resolved[patch["name"]] = sorted(chosen)
        listed = {diff_file(patch, p) for p in patch.get("diffs", [])}
        for d in sorted(listed):
            if not os.path.isfile(d):
                problems.append(f"{patch['name']}: {os.path.relpath(d, REPO)} does not exist")
            elif "\n--- /dev/null\n" in "\n" + read_text(d):
                problems.append(f"{os.path.relpath(d, REPO)} creates a file: new files live in this repository at their "
                                "ComfyUI path and go in the patch's 'files'")
        for dirpath, _, names in os.walk(os.path.join(UPSTREAM, patch["name"])):
            problems.extend(f"{os.path.relpath(os.path.join(dirpath, n), REPO)} is not in {patch['name']}'s 'diffs' in series.json"
                            for n in sorted(names) if os.path.join(dirpath, n) not in listed)
    names = {p["name"] for p in manifest["patches"]}
    if os.path.isdir(UPSTREAM):
        problems.extend(f"patches/upstream/{d} belongs to no patch in series.json" for d in sorted(os.listdir(UPSTREAM)) if d not in names)
    excluded = manifest["excluded"]
    for f, claimed in owners.items():
        if len(claimed) > 1:
            problems.append(f"{f} is in several patches: {', '.join(claimed)}")
        elif not claimed and f not in excluded:
            problems.append(f"{f} is in no patch: add it to one in patches/series.json (or to 'excluded' with a reason)")
        elif claimed and f in excluded:
            problems.append(f"{f} is both excluded and in {claimed[0]}")
    problems.extend(f"excluded file {f} does not exist" for f in excluded if f not in owners)
    return resolved, problems


def resolve_strict(manifest):
    resolved, problems = resolve(manifest)
    if problems:
        raise SeriesError("the series does not match the repository:\n  " + "\n  ".join(problems))
    return resolved


def git(tree, *args, env=None, capture=True):
    """Run git in `tree` with no user or system configuration, so output is the same everywhere.
    The ceiling stops git from finding an enclosing repository (this one: .comfyui/ lies inside it),
    so `git apply` in a tree that is not a repository patches that tree, not ours."""
    full_env = dict(os.environ, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, LC_ALL="C", TZ="UTC",
                    GIT_CEILING_DIRECTORIES=os.path.dirname(os.path.abspath(tree)))
    full_env.update(env or {})
    result = subprocess.run(["git", "-C", tree, *args], env=full_env, capture_output=capture, text=True)
    if result.returncode != 0:
        raise SeriesError(f"git {' '.join(args)} failed in {tree}:\n{result.stdout or ''}{result.stderr or ''}")
    return result.stdout


def author():
    """'Name <email>' of whoever builds the series: H3SP_AUTHOR, else this repository's git identity."""
    if os.environ.get("H3SP_AUTHOR"):
        return os.environ["H3SP_AUTHOR"]
    get = [subprocess.run(["git", "-C", REPO, "config", key], capture_output=True, text=True).stdout.strip()
           for key in ("user.name", "user.email")]
    if not all(get):
        raise SeriesError("no author for the commits: set H3SP_AUTHOR='Your Name <you@example.com>' "
                          "or git config user.name / user.email (the person who signs ComfyUI's CLA)")
    return f"{get[0]} <{get[1]}>"


def identity(manifest):
    """Environment that fixes author, committer and dates of the commits build and check make."""
    name, email = author().rsplit(" <", 1)
    email = email.rstrip(">")
    return {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": manifest["date"],
            "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email, "GIT_COMMITTER_DATE": manifest["date"]}


def comfyui_dir():
    path = os.environ.get("COMFYUI_DIR") or (DEFAULT_BASE if os.path.isdir(DEFAULT_BASE) else None)
    if not path:
        raise SeriesError("no base tree: run scripts/comfyui_tree.sh .venv/bin/python (unpacks "
                          "../shared/comfyui/comfyui-h3-newest.tar.gz into .comfyui/), or set COMFYUI_DIR to a git checkout of that base")
    return os.path.abspath(path)


def verify_base(manifest, tree, label=None):
    """Refuse a base whose files the series touches or depends on differ from the pinned ones (sha256)."""
    wrong = []
    for path, expected in sorted(manifest["base"]["sha256"].items()):
        try:
            with open(os.path.join(tree, path), "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except FileNotFoundError:
            wrong.append(f"{path}: missing")
            continue
        if digest != expected:
            wrong.append(f"{path}: sha256 {digest[:16]}..., expected {expected[:16]}...")
    if wrong:
        raise SeriesError(f"{label or tree} is not the {manifest['base']['name']} base:\n  " + "\n  ".join(wrong))


def edit_lines(edit):
    """(anchor lines, inserted lines) of an edit; `after_line` / `insert_line` are a line or a list of lines."""
    def lines(v):
        return [v] if isinstance(v, str) else list(v)
    return lines(edit["after_line"]), lines(edit["insert_line"])


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


def whitespace_errors(patch, path):
    """Refuse what `git am` would warn about in an added text file: trailing blanks, blank lines at EOF."""
    with open(os.path.join(REPO, path), "rb") as f:
        data = f.read()
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        return  # binary test data
    bad = [str(i) for i, line in enumerate(lines, 1) if line != line.rstrip(" \t\r")]
    if bad or data.endswith(b"\n\n") or data.rstrip(b"\n") != data.rstrip(b"\n \t"):
        where = f"trailing blanks on line(s) {', '.join(bad[:5])}" if bad else "blank line(s) at the end"
        raise SeriesError(f"{patch['name']}: {path} has {where}; git am would warn: remove them")


def apply_patch(tree, patch, files, upto_diff=None):
    """One patch's changes on `tree`: add its files, apply its diffs in order, make its edits.
    upto_diff: stop right before the diff of that path (build.py --diff needs its preimage)."""
    for path in files:
        whitespace_errors(patch, path)
        dest = os.path.join(tree, path)
        if os.path.exists(dest):
            raise SeriesError(f"{patch['name']}: {path} already exists in the base (or an earlier patch); "
                              "a patch changes upstream files only through 'diffs' or 'edits'")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy2(os.path.join(REPO, path), dest)  # copy2: unchanged files keep their mtime, so their .pyc stays valid
    for path in patch.get("diffs", []):
        if path == upto_diff:
            return
        diff = diff_file(patch, path)
        try:
            # --whitespace=error: what would make `git am` warn (trailing blanks, a blank line at EOF) fails here
            git(tree, "apply", "--whitespace=error", diff)
        except SeriesError as e:
            raise SeriesError(f"{patch['name']}: {os.path.relpath(diff, REPO)} does not apply to the tree after the earlier "
                              f"patches (remake it with patches/build.py --diff):\n{e}") from None
    for edit in patch.get("edits", []):
        apply_edit(tree, patch, edit)


def clone(source, dest):
    """A clean clone of `source` at its HEAD (committed content only, no work-tree edits)."""
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", source, dest], check=True,
                   env=dict(os.environ, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull))


def sync_tree(source, dest):
    """Make `dest` a copy of `source` (its .git left out), copying only files whose size or mtime
    differ and deleting everything else except __pycache__, so a rebuild is cheap and starts clean."""
    wanted = set()
    for dirpath, dirnames, filenames in os.walk(source):
        dirnames[:] = [d for d in dirnames if d not in (".git", "__pycache__")]
        rel = os.path.relpath(dirpath, source)
        os.makedirs(os.path.join(dest, rel), exist_ok=True)
        for name in filenames:
            s, d = os.path.join(dirpath, name), os.path.join(dest, rel, name)
            wanted.add(os.path.normpath(d))
            ss = os.stat(s)
            try:
                ds = os.lstat(d)
                same = ds.st_size == ss.st_size and ds.st_mtime_ns == ss.st_mtime_ns
            except FileNotFoundError:
                same = False
            if not same:
                if os.path.lexists(d):
                    os.remove(d)
                shutil.copy2(s, d)
    for dirpath, _, filenames in os.walk(dest, topdown=False):
        rel = os.path.relpath(dirpath, dest)
        if "__pycache__" in rel.split(os.sep):
            continue  # a stale .pyc is harmless: Python checks it against its source
        if rel != "." and not os.path.isdir(os.path.join(source, rel)):
            shutil.rmtree(dirpath)  # a folder the base lacks: a test run's leftover or an earlier series
            continue
        for name in filenames:
            if os.path.normpath(os.path.join(dirpath, name)) not in wanted:
                os.remove(os.path.join(dirpath, name))
