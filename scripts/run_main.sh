#!/usr/bin/env bash
# The main job: MiniMax H3 sequence parallelism as a headless ComfyUI workflow in a patched tree of
# the series' base (.comfyui/patched-main: the base + this repository's series, rebuilt every run).
# Defaults: a small generated H3 checkpoint and LoRA, KSampler at cfg 3 and at cfg 1, 2 CPU ranks.
# --help and argument errors answer before any set-up.
# Other arguments go to scripts/h3_sequence_parallel.py (--help).
#   scripts/run_main.sh [--python PATH] [--device cuda] [...]
# Which python: --python PATH; else with --device cuda the python3 on PATH when its torch sees CUDA
# (a GPU machine's installed CUDA torch; the project's .venv holds a CPU build); else .venv.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py="" device=cpu args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) py=${2:?--python needs a path}; shift 2 ;;
    --python=*) py=${1#--python=}; shift ;;
    --device) device=${2:-}; args+=("$1" "${2:-}"); shift 2 ;;
    --device=*) device=${1#--device=}; args+=("$1"); shift ;;
    *) args+=("$1"); shift ;;
  esac
done
# the arguments first (the script checks them with the standard library alone): --help and a bad
# argument answer at once, before any set-up
python3 "$root/scripts/h3_sequence_parallel.py" --check-args "${args[@]}" || exit $?
case " ${args[*]} " in *" -h "*|*" --help "*) exit 0 ;; esac
if [ -z "$py" ] && [ "$device" = cuda ]; then
  if python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    py=$(command -v python3)
  else
    echo "run_main: --device cuda needs a python whose torch sees CUDA; python3 on PATH does not: pass --python PATH" >&2
    exit 2
  fi
fi
[ -n "$py" ] || py=$(bash "$root/scripts/setup_env.sh")
base=$(bash "$root/scripts/comfyui_tree.sh" "$py")
tree="$root/.comfyui/patched-main"  # not .comfyui/patched: a test run may be rebuilding that one
COMFYUI_DIR="$base" "$py" "$root/patches/build.py" --tree "$tree" >/dev/null
cd "$root"
# the tree first: worker processes import ComfyUI from it too; media stand-ins where torchvision/torchaudio are missing
export PYTHONPATH="$tree:$root/scripts/media_site${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" scripts/h3_sequence_parallel.py --comfyui "$tree" "${args[@]}"
