#!/usr/bin/env bash
# The test command. Sets up the environment and the base tree (scripts/comfyui_tree.sh), rebuilds
# the patched tree .comfyui/patched (the base + this repository's series, patches/build.py --tree),
# lints with ComfyUI's ruff rules, then runs pytest INSIDE the patched tree with its own pytest.ini:
# the series' test files and upstream's tests-unit/comfy_test/test_minimax_h3_model.py. Then the
# repository-only checks (tests-unit/infra_test) from here, and the cross-platform collection.
#   scripts/test.sh                          everything
#   scripts/test.sh -k layout -x             options go to pytest
#   COMFY_TEST_SLOW=1 scripts/test.sh        also the slow tier (4-8 ranks), which skips otherwise
#   scripts/test.sh tests-unit/comfy_test/test_minimax_h3_model.py   only these paths (tree or infra_test)
# A run that collects nothing fails (pytest's exit code 5), and so does one that leaves files behind
# (in the patched tree or in its private TMPDIR).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$root/scripts/setup_env.sh")
base=$(bash "$root/scripts/comfyui_tree.sh" "$py")
tree="$root/.comfyui/patched"
# one run at a time rebuilds and uses the tree (others on this machine wait rather than see it change)
mkdir -p "$root/.comfyui"
exec 9>"$root/.comfyui/patched.lock"
flock -n 9 || { echo "test.sh: waiting for another scripts/test.sh run to finish" >&2; flock 9; }
listing=$(COMFYUI_DIR="$base" "$py" "$root/patches/build.py" --tree "$tree")
lint=$(awk '$1 == "lint" && $2 ~ /\.py$/ {print $2}' <<<"$listing")
series_tests=$(awk '$1 == "test" {print $2}' <<<"$listing")

tree_paths=() infra_paths=() opts=() collect_only=0
for arg in "$@"; do
  case "$arg" in
    tests-unit/infra_test*) infra_paths+=("$arg") ;;
    tests-unit/*) tree_paths+=("$arg") ;;
    --collect-only|--co) collect_only=1; opts+=("$arg") ;;
    *) opts+=("$arg") ;;
  esac
done
if [ $# -eq 0 ] || { [ ${#tree_paths[@]} -eq 0 ] && [ ${#infra_paths[@]} -eq 0 ]; }; then
  # upstream's own H3 test runs in every run: the series must keep it green
  mapfile -t tree_paths < <(printf '%s\n' tests-unit/comfy_test/test_minimax_h3_model.py $series_tests | sort -u)
  infra_paths=(tests-unit/infra_test)
  all=1
fi

"$py" -m ruff check --quiet "$root"
# the upstream files the series edits, with the tree's own ruff configuration
[ -z "$lint" ] || (cd "$tree" && "$py" -m ruff check --quiet $lint)

# torchvision / torchaudio stand-ins where this machine lacks them (here and in every worker process)
export PYTHONPATH="$root/scripts/media_site${PYTHONPATH:+:$PYTHONPATH}"
# a private TMPDIR: whatever a test leaves in it (or in the tree) is found below
scratch=$(mktemp -d "${TMPDIR:-/tmp}/h3sp-test.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/tmp"
touch "$scratch/stamp"
rcs=()
run() { set +e; "$@"; rcs+=($?); set -e; }
cd "$tree"
# one pytest process, as upstream's CI runs tests-unit
if [ ${#tree_paths[@]} -gt 0 ]; then
  run env TMPDIR="$scratch/tmp" "$py" "$root/scripts/pytest_in_tree.py" -p no:cacheprovider \
    --basetemp="$scratch/tmp/pytest" "${opts[@]}" "${tree_paths[@]}"
fi
if [ ${#infra_paths[@]} -gt 0 ]; then
  cd "$root"
  # no .pyc: a check that runs code in the pristine base must not write into it
  run env TMPDIR="$scratch/tmp" H3SP_BASE_TREE="$base" H3SP_PATCHED_TREE="$tree" PYTHONDONTWRITEBYTECODE=1 \
    "$py" -m pytest -p no:cacheprovider --basetemp="$scratch/tmp/pytest-infra" \
    "${opts[@]}" "${infra_paths[@]}"
fi
if [ "${all:-0}" = 1 ] && [ $collect_only = 0 ]; then
  # every test module imports on Windows and macOS too (simulated here), and for real on Linux
  run env TMPDIR="$scratch/tmp" COMFYUI_DIR="$base" "$py" "$root/scripts/collect_as.py" "$tree"
fi

left=$( (find "$tree" -newer "$scratch/stamp" \( -type f -o -type d -empty \) -not -path '*/__pycache__*'; \
         find "$scratch/tmp" -mindepth 1 -maxdepth 1 -not -name 'pytest*' -not -name 'torchinductor_*') | sort)  # torch's own compile cache
if [ -n "$left" ]; then
  echo "test.sh: the run left files behind:" >&2
  echo "$left" | sed 's/^/  /' >&2
  rcs+=(1)
fi
# exit 5 (nothing collected) fails unless another part of the run collected tests
worst=5
for rc in "${rcs[@]}"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then worst=$rc; break; fi
  [ "$rc" -eq 0 ] && worst=0
done
[ "$worst" -eq 5 ] && echo "test.sh: no tests collected; that is a failure" >&2
exit "$worst"
