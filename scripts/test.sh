#!/usr/bin/env bash
# The test command: set up the environment and a ComfyUI tree of the pinned base (COMFYUI_DIR, else
# unpacked or cloned into .comfyui/), lint with ComfyUI's ruff rules, run tests-unit inside that tree.
# Extra arguments go to pytest (e.g. scripts/test.sh -m "not slow" -k layout).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$root/scripts/setup_env.sh")
COMFYUI_DIR=$(bash "$root/scripts/comfyui_tree.sh" "$py")
export COMFYUI_DIR
# torchvision / torchaudio stand-ins where this machine lacks them (here and in every worker process)
export PYTHONPATH="$root/scripts/media_site${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
"$py" -m ruff check --quiet .
exec "$py" -m pytest -q "$@"
