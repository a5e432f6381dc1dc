#!/usr/bin/env bash
# Print the path of a ComfyUI tree at the pinned base commit, making one if needed:
#   1. $COMFYUI_DIR when set (a checkout of the pinned base, patched or not);
#   2. else ../shared/comfyui/comfyui-<short>.tar.gz unpacked into the git-ignored .comfyui/;
#   3. else a clone of ComfyUI at the pinned commit into .comfyui/.
# Then ComfyUI's CPU import dependencies (requirements-comfyui.txt) go into the given python.
#   usage: scripts/comfyui_tree.sh PYTHON
set -euo pipefail
BASE=0f1fa67ad8a68b62c65ebc97a7bf485df2459c3a
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${1:?usage: comfyui_tree.sh PYTHON}
if [ -n "${COMFYUI_DIR:-}" ]; then
  dir=$(cd "$COMFYUI_DIR" && pwd)
else
  dir="$root/.comfyui/comfyui-${BASE:0:7}"
  if [ ! -f "$dir/.h3sp-complete" ]; then
    rm -rf "$dir"
    mkdir -p "$root/.comfyui"
    tarball="$root/../shared/comfyui/comfyui-${BASE:0:7}.tar.gz"
    if [ -f "$tarball" ]; then
      tar -xzf "$tarball" -C "$root/.comfyui"
    else
      echo "comfyui_tree: $tarball not found; cloning ComfyUI at $BASE" >&2
      git clone -q https://github.com/comfyanonymous/ComfyUI "$dir" >&2
      git -C "$dir" checkout -q "$BASE" >&2
    fi
    touch "$dir/.h3sp-complete"
  fi
fi
[ -f "$dir/comfy/model_patcher.py" ] || { echo "comfyui_tree: $dir is not a ComfyUI tree (no comfy/model_patcher.py)" >&2; exit 2; }
stamp="$("$py" -c 'import sys; print(sys.prefix)')/.h3sp-comfyui-requirements.sha256"
want=$(sha256sum "$root/requirements-comfyui.txt" | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$py" -m pip install -q -r "$root/requirements-comfyui.txt" >&2
  echo "$want" > "$stamp"
fi
echo "$dir"
