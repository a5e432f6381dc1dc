"""Apply the series to a clean copy of the base and test the result.

    patches/check [--bisect] [--keep]

The base is COMFYUI_DIR, else .comfyui/comfyui-h3-newest (scripts/comfyui_tree.sh makes it: the
shared tarball unpacked, one git commit).
1. clone the base twice (base, patched) and check it is the series' base;
2. plain `git am --whitespace=error` of every patch of patches/series, in order, onto the patched
   copy (a conflict or a whitespace warning fails); after each patch, import the modules it adds and
   comfy.model_base there (--bisect: also run the tests the patch adds, with only the earlier
   patches present);
3. the patched tree equals the one scripts/test.sh tests (patches/build.py --tree): the series is in sync;
4. import check of every module the series adds; ComfyUI loads its extra nodes (ours registered,
   no import failure the base does not have);
5. upstream's own tests-unit/comfy_test/test_minimax_h3_model.py, then our tests, in the patched tree;
6. ComfyUI's tests-unit on the base and on the patched tree (our tests left out), compared test by
   test: a test that passes on the base must pass after patching.

Every pytest run goes through scripts/pytest_in_tree.py (--cpu without CUDA, as upstream's tests
need) with scripts/media_site on PYTHONPATH (torchvision / torchaudio stand-ins where they are not
installed), the same on both trees. A JSON summary goes to bench/results/patch_check.json.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

import build
import manifest as series
from build import is_test
from manifest import HERE, REPO, SeriesError, git

RESULT_JSON = os.path.join(REPO, "bench", "results", "patch_check.json")
MEDIA_SITE = os.path.join(REPO, "scripts", "media_site")
CPU = "import torch; from comfy.cli_args import args; args.cpu = not torch.cuda.is_available(); "
UPSTREAM_H3_TEST = "tests-unit/comfy_test/test_minimax_h3_model.py"
PYTEST = [sys.executable, os.path.join(REPO, "scripts", "pytest_in_tree.py"), "-q", "-p", "no:cacheprovider"]
NODE_ID = "MiniMaxH3SequenceParallel"
LOAD_NODES = ("import asyncio, json, nodes; failed = asyncio.run(nodes.init_builtin_extra_nodes()); "
              f"print(json.dumps({{'failed': sorted(failed), 'node': nodes.NODE_DISPLAY_NAME_MAPPINGS.get('{NODE_ID}')}}))")


class Run:
    """Runs commands in a tree with a clean environment, logging output, remembering the commands."""

    def __init__(self, work):
        self.work, self.commands, self.logs = work, [], 0
        self.env = {k: v for k, v in os.environ.items() if k not in ("COMFYUI_DIR", "PYTHONPATH")}
        # git am needs a committer, not the builder's: the author comes from the patch
        self.env.update(PYTHONDONTWRITEBYTECODE="1", GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull,
                        PYTHONPATH=MEDIA_SITE, GIT_COMMITTER_NAME="patches-check", GIT_COMMITTER_EMAIL="check@localhost",
                        GIT_CEILING_DIRECTORIES=work)

    def __call__(self, tree, argv, label, timeout=1800, env=None):
        self.logs += 1
        log = os.path.join(self.work, f"{self.logs:02d}-{label}.log")
        shown = " ".join(a if " " not in a and a else repr(a) for a in argv)
        self.commands.append({"step": label, "cwd": os.path.basename(tree), "command": shown, "log": os.path.basename(log)})
        start = time.monotonic()
        with open(log, "w") as out:
            try:
                rc = subprocess.run(argv, cwd=tree, env={**self.env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        with open(log) as f:
            text = f.read()
        return rc, text, round(time.monotonic() - start, 1)


def module_names(paths):
    return [p[:-3].replace("/", ".").removesuffix(".__init__") for p in paths
            if p.endswith(".py") and p.startswith(("comfy/", "comfy_extras/"))]


def apply_series(run, tree, manifest, resolved, names, bisect):
    """git am each patch; import what it adds; with bisect, run the tests it adds."""
    steps = []
    for entry, name in zip(manifest["patches"], names):
        rc, text, _ = run(tree, ["git", "am", "--quiet", "--whitespace=error", os.path.join(HERE, name)], f"am-{entry['name']}")
        if rc != 0 or "warning" in text:
            run(tree, ["git", "am", "--abort"], "am-abort")
            raise SeriesError(f"git am {name} failed or warned on the base:\n{text.strip()}")
        modules = ["comfy.model_base"] + module_names(resolved[entry["name"]])
        rc, text, secs = run(tree, [sys.executable, "-c", CPU + "import " + ", ".join(modules)], f"import-{entry['name']}")
        step = {"patch": name, "imports": modules, "import_ok": rc == 0}
        if rc != 0:
            raise SeriesError(f"after {name}: importing {', '.join(modules)} failed:\n{text[-3000:]}")
        tests = [f for f in resolved[entry["name"]] if is_test(f)]
        if bisect and tests:
            rc, text, secs = run(tree, PYTEST + tests, f"tests-{entry['name']}")
            step.update(tests=summary_line(text), tests_ok=rc == 0, seconds=secs)
            if rc != 0:
                raise SeriesError(f"after {name}: its own tests fail:\n{text[-3000:]}")
        steps.append(step)
        print(f"  applied {name}" + (f"; its tests: {step['tests']}" if "tests" in step else ""))
    return steps


def out_of_sync(tree, manifest, base_dir, work):
    """Files that differ between the tree git am made and the one patches/build.py --tree makes."""
    expected = os.path.join(work, "expected")
    build.build_tree(manifest, base_dir, expected)
    bad = []
    for dirpath, dirnames, filenames in os.walk(expected):
        dirnames[:] = [d for d in dirnames if d not in (".git", "__pycache__")]
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), expected)
            with open(os.path.join(dirpath, name), "rb") as a:
                want = a.read()
            try:
                with open(os.path.join(tree, rel), "rb") as b:
                    same = b.read() == want
            except FileNotFoundError:
                same = False
            if not same:
                bad.append(rel)
    shutil.rmtree(expected)
    return bad


def summary_line(text):
    lines = [line.strip("= ") for line in text.splitlines() if " in " in line and any(
        w in line for w in (" passed", " failed", " error", " skipped", " deselected", "no tests ran"))]
    return lines[-1] if lines else "(no pytest summary)"


def outcomes(junit):
    """{test id: passed | failed | error | skipped}, the worst outcome when an id repeats."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        tags = {child.tag for child in case}
        outcome = "error" if "error" in tags else "failed" if "failure" in tags else "skipped" if "skipped" in tags else "passed"
        if rank[outcome] >= rank.get(found.get(tid), -1):
            found[tid] = outcome
    return found


def count(results):
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for outcome in results.values():
        counts[outcome] += 1
    return counts


def comfyui_tests(run, tree, label, ignores):
    junit = os.path.join(run.work, f"junit-{label}.xml")
    argv = PYTEST + ["tests-unit", "--continue-on-collection-errors", f"--junitxml={junit}"] + [f"--ignore={p}" for p in ignores]
    rc, text, secs = run(tree, argv, f"comfyui-tests-{label}")
    if not os.path.exists(junit):
        raise SeriesError(f"ComfyUI's tests-unit did not run on the {label} tree (exit {rc}):\n{text[-3000:]}")
    results = outcomes(junit)
    return results, {"exit_code": rc, "seconds": secs, "summary": summary_line(text), **count(results)}


def our_test_ignores(base_tree, resolved):
    """Our test files for the ComfyUI run: whole directories the base does not have, else files."""
    ignores = set()
    for path in (f for files in resolved.values() for f in files if f.startswith("tests-unit/")):
        top = "/".join(path.split("/")[:2])
        if not os.path.exists(os.path.join(base_tree, top)):
            ignores.add(top)
        elif path.endswith("_test.py"):
            ignores.add(path)
    return sorted(ignores)


def check(args, manifest, run, report):
    work = run.work
    resolved = series.resolve_strict(manifest)
    with open(os.path.join(HERE, "series"), encoding="utf-8") as f:
        names = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    if names != [p["name"] + ".patch" for p in manifest["patches"]]:
        raise SeriesError(f"patches/series lists {names}, series.json {[p['name'] for p in manifest['patches']]}: run patches/build")
    base_tree, tree = os.path.join(work, "base"), os.path.join(work, "patched")
    for t in (base_tree, tree):
        series.clone(args.comfyui_dir, t)
    series.verify_base(manifest, base_tree, label=args.comfyui_dir)
    report["series"] = [{"patch": n, "bytes": os.path.getsize(os.path.join(HERE, n))} for n in names]

    print(f"git am {len(names)} patches onto a clean copy of {args.comfyui_dir}")
    report["applied"] = apply_series(run, tree, manifest, resolved, names, args.bisect)
    report["commits"] = git(tree, "log", "--format=%s", f"-{len(names)}").splitlines()[::-1]

    stale = out_of_sync(tree, manifest, args.comfyui_dir, work)
    report["in_sync_with_repository"] = not stale
    if stale:
        raise SeriesError("the series is out of date with this repository (run patches/build): " + ", ".join(stale))
    print("  patched tree holds exactly this repository's files")

    added = module_names([f for files in resolved.values() for f in files])
    rc, text, _ = run(tree, [sys.executable, "-c", CPU + "import comfy.model_base, " + ", ".join(added)], "import-check")
    report["import_check"] = {"ok": rc == 0, "command": run.commands[-1]["command"]}
    if rc != 0:
        raise SeriesError(f"import check failed in the patched tree:\n{text[-3000:]}")
    print(f"  import check: ok, {len(added)} modules (with torchvision/torchaudio stand-ins)")

    loads = {}
    for label, t in (("base", base_tree), ("patched", tree)):
        rc, text, _ = run(t, [sys.executable, "-c", CPU + LOAD_NODES], f"load-nodes-{label}")
        loads[label] = json.loads(text.strip().splitlines()[-1]) if rc == 0 else {"error": text[-2000:]}
    report["node_loading"] = loads
    if "error" in loads["base"] or "error" in loads["patched"] or loads["patched"]["failed"] != loads["base"]["failed"] \
            or not loads["patched"]["node"]:
        raise SeriesError(f"ComfyUI's extra nodes load differently after patching: {json.dumps(loads)[:3000]}")
    print(f"  nodes.init_builtin_extra_nodes(): '{loads['patched']['node']}' registered; the same "
          f"{len(loads['base']['failed'])} extras fail to import as on the base (missing optional packages)")

    rc, text, secs = run(tree, PYTEST + [UPSTREAM_H3_TEST], "upstream-h3-test")
    report["upstream_h3_test"] = {"exit_code": rc, "seconds": secs, "summary": summary_line(text)}
    print(f"  upstream's {UPSTREAM_H3_TEST} in the patched tree: {summary_line(text)}")
    if rc != 0:
        raise SeriesError(f"upstream's {UPSTREAM_H3_TEST} fails in the patched tree:\n{text[-3000:]}")

    junit = os.path.join(work, "junit-ours.xml")
    ours_files = sorted(f for files in resolved.values() for f in files if is_test(f))
    rc, text, secs = run(tree, PYTEST + ours_files + [f"--junitxml={junit}"], "our-tests")
    ours = outcomes(junit) if os.path.exists(junit) else {}
    report["our_tests"] = {"exit_code": rc, "seconds": secs, "summary": summary_line(text), **count(ours)}
    print(f"  our tests in the patched tree: {summary_line(text)} (exit {rc}, {secs} s)")
    if rc != 0:
        failed = [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        print("\n".join(f"    {line}" for line in failed) or text[-3000:])
        print(f"    full output: {os.path.join(work, run.commands[-1]['log'])}")

    ignores = our_test_ignores(base_tree, resolved)
    base, report["comfyui_base"] = comfyui_tests(run, base_tree, "base", ignores)
    patched, report["comfyui_patched"] = comfyui_tests(run, tree, "patched", ignores)
    report["comfyui_ignored_in_patched"] = ignores
    regressions = sorted(t for t, o in base.items() if o == "passed" and patched.get(t) != "passed")
    new_failures = sorted(t for t, o in patched.items() if o in ("failed", "error") and base.get(t) not in ("failed", "error"))
    report["regressions"], report["new_failures"] = regressions, new_failures
    report["counts"] = {"patches": len(names), "our_tests": count(ours), "comfyui_tests_base": count(base),
                        "comfyui_tests_patched": count(patched), "regressions": len(regressions),
                        "new_failures": len(new_failures)}
    for label in ("base", "patched"):
        c = report[f"comfyui_{label}"]
        print(f"  ComfyUI tests-unit, {label:7s}: {c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
              f"{c['skipped']} skipped ({c['seconds']} s)")
    for t in regressions:
        print(f"  REGRESSION: {t}: passed on the base, {patched.get(t, 'missing')} after patching")
    for t in new_failures:
        print(f"  NEW FAILURE: {t}: {patched[t]} after patching, {base.get(t, 'absent')} on the base")
    return rc == 0 and not regressions and not new_failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bisect", action="store_true", help="also run each patch's own tests right after applying it")
    parser.add_argument("--keep", action="store_true", help="keep the temporary trees and logs")
    args = parser.parse_args()
    report = {"what": "patches/series applied with git am to a clean copy of the base; our tests inside the patched "
                      "tree; ComfyUI's tests-unit on the base and on the patched tree",
              "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    work = tempfile.mkdtemp(prefix="h3sp-check-")
    run, ok = Run(work), False
    try:
        manifest = series.load()
        args.comfyui_dir = series.comfyui_dir()
        report["base"] = manifest["base"]["name"]
        report["base_sha256"], report["comfyui_dir"] = manifest["base"]["sha256"], args.comfyui_dir
        ok = check(args, manifest, run, report)
    except SeriesError as e:
        report["error"] = str(e)
        print(f"patches/check: {e}", file=sys.stderr)
    finally:
        report["result"] = "pass" if ok else "fail"
        report["commands"] = run.commands
        os.makedirs(os.path.dirname(RESULT_JSON), exist_ok=True)
        with open(RESULT_JSON, "w", encoding="utf-8") as f:
            f.write(json.dumps(report, indent=2) + "\n")
        if args.keep or not ok:
            print(f"trees and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"patches/check: {'PASS' if ok else 'FAIL'} (summary in {os.path.relpath(RESULT_JSON, REPO)})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
