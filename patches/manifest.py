"""The patch series manifest (series.json) and the checks build and check share.

series.json names, in order, each patch's subject, message file, the repository files it adds
(globs allowed), the upstream files it replaces with one of ours, and the line edits it makes to
upstream files. Every file under the covered directories must belong to exactly one patch or be
excluded with a reason, so that the series can never silently miss a file.
"""

import fnmatch
import hashlib
import json
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MANIFEST = os.path.join(HERE, "series.json")


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


def resolve(manifest):
    """{patch name: sorted file list}; raises SeriesError naming unclaimed or doubly claimed files."""
    files = repo_files(manifest)
    owners = {f: [] for f in files}
    resolved, problems = {}, []
    for patch in manifest["patches"]:
        chosen = []
        for pattern in patch["files"]:
            folder, leaf = pattern.rsplit("/", 1)
            matches = [f for f in files if f.rsplit("/", 1)[0] == folder and fnmatch.fnmatchcase(f.rsplit("/", 1)[1], leaf)]
            if not matches:
                problems.append(f"{patch['name']}: '{pattern}' matches no file in the repository")
            chosen.extend(m for m in matches if m not in chosen)
        for f in chosen:
            owners[f].append(patch["name"])
        resolved[patch["name"]] = sorted(chosen)
        for target, source in patch.get("replace", {}).items():
            if not os.path.isfile(os.path.join(REPO, source)):
                problems.append(f"{patch['name']}: replacement source {source} for {target} does not exist")
    excluded = manifest["excluded"]
    for f, names in owners.items():
        if len(names) > 1:
            problems.append(f"{f} is in several patches: {', '.join(names)}")
        elif not names and f not in excluded:
            problems.append(f"{f} is in no patch: add it to one in patches/series.json (or to 'excluded' with a reason)")
        elif names and f in excluded:
            problems.append(f"{f} is both excluded and in {names[0]}")
    problems.extend(f"excluded file {f} does not exist" for f in excluded if f not in owners)
    if problems:
        raise SeriesError("the series does not match the repository:\n  " + "\n  ".join(problems))
    return resolved


def git(tree, *args, env=None, capture=True):
    """Run git in `tree` with no user or system configuration, so output is the same everywhere."""
    full_env = dict(os.environ, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, LC_ALL="C", TZ="UTC")
    full_env.update(env or {})
    result = subprocess.run(["git", "-C", tree, *args], env=full_env, capture_output=capture, text=True)
    if result.returncode != 0:
        raise SeriesError(f"git {' '.join(args)} failed in {tree}:\n{result.stdout or ''}{result.stderr or ''}")
    return result.stdout


def identity(manifest):
    """Environment that fixes author, committer and dates of the commits build and check make."""
    name, email = manifest["author"].rsplit(" <", 1)
    return {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email.rstrip(">"), "GIT_AUTHOR_DATE": manifest["date"],
            "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email.rstrip(">"), "GIT_COMMITTER_DATE": manifest["date"]}


def comfyui_dir():
    path = os.environ.get("COMFYUI_DIR")
    if not path:
        raise SeriesError("COMFYUI_DIR is not set: point it at a git checkout of ComfyUI "
                          "0f1fa67ad8a68b62c65ebc97a7bf485df2459c3a (v0.33.0), e.g. COMFYUI_DIR=/work/comfyui")
    return os.path.abspath(path)


def verify_base(manifest, tree, label=None):
    """Refuse a base whose committed content is not the pinned one (compares the files the series
    touches or depends on by sha256; the checkout tool's own commit id says nothing)."""
    wrong = []
    for path, expected in sorted(manifest["base"]["sha256"].items()):
        try:
            blob = subprocess.run(["git", "-C", tree, "show", f"HEAD:{path}"], capture_output=True, check=True).stdout
        except subprocess.CalledProcessError:
            wrong.append(f"{path}: missing from HEAD")
            continue
        if hashlib.sha256(blob).hexdigest() != expected:
            wrong.append(f"{path}: sha256 {hashlib.sha256(blob).hexdigest()[:16]}..., expected {expected[:16]}...")
    if wrong:
        base = manifest["base"]
        raise SeriesError(f"{label or tree} is not ComfyUI {base['upstream_commit'][:7]} (v{base['version']}) at HEAD:\n  "
                          + "\n  ".join(wrong))


def edit_lines(edit):
    """(anchor lines, inserted lines) of an edit; `after_line` / `insert_line` are a line or a list of lines."""
    def lines(v):
        return [v] if isinstance(v, str) else list(v)
    return lines(edit["after_line"]), lines(edit["insert_line"])


def clone(source, dest):
    """A clean clone of `source` at its HEAD (committed content only, no work-tree edits)."""
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", source, dest], check=True,
                   env=dict(os.environ, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull))
