#!/usr/bin/env bash
# The main job: set up the environment and a ComfyUI tree of the pinned base, then run MiniMax H3
# sequence parallelism as a headless ComfyUI workflow (defaults: a small generated H3 checkpoint and
# LoRA, KSampler with cfg > 1, 2 CPU ranks). Arguments go to the script (--help).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$root/scripts/setup_env.sh")
COMFYUI_DIR=$(bash "$root/scripts/comfyui_tree.sh" "$py")
export COMFYUI_DIR
cd "$root"
exec "$py" scripts/h3_sequence_parallel.py "$@"
