#!/usr/bin/env bash
# Create or reuse the project's virtual environment and install what the project needs.
# Idempotent: a second run with unchanged requirements.txt only checks a stamp and returns.
#   usage: scripts/setup_env.sh            (prints nothing on success but the venv's python path)
#   env:   H3SP_VENV=path  to use another virtual environment (default: .venv in the repository)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${H3SP_VENV:-$root/.venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
py="$venv/bin/python"
stamp="$venv/.h3sp-requirements.sha256"
want=$(sha256sum "$root/requirements.txt" | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$py" -c "import torch, safetensors, comfy_kitchen" 2>/dev/null; then
  if ! "$py" -c "import torch" 2>/dev/null; then
    # a CPU build lies on local disk for this version; any other spec would download a CUDA build
    "$py" -m pip install -q torch==2.13.0 >&2
  fi
  "$py" -m pip install -q -r "$root/requirements.txt" >&2
  echo "$want" > "$stamp"
fi
echo "$py"
