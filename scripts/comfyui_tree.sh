#!/usr/bin/env bash
# Print the path of a pristine ComfyUI tree of the series' base (comfyui-h3-newest), making one if needed:
#   1. $COMFYUI_DIR when set (a checkout of that base);
#   2. else ../shared/comfyui/comfyui-h3-newest.tar.gz unpacked into the git-ignored .comfyui/.
# The tree is made a git repository (one commit) if it is not one: patches/build and patches/check
# clone it. Nobody edits it: tests run in a copy (patches/build.py --tree). Then ComfyUI's CPU
# import dependencies (requirements-comfyui.txt) go into the given python.
#   usage: scripts/comfyui_tree.sh PYTHON
set -euo pipefail
NAME=comfyui-h3-newest
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${1:?usage: comfyui_tree.sh PYTHON}
if [ -n "${COMFYUI_DIR:-}" ]; then
  dir=$(cd "$COMFYUI_DIR" && pwd)
else
  dir="$root/.comfyui/$NAME"
  if [ ! -f "$root/.comfyui/$NAME.complete" ]; then
    tarball="$root/../shared/comfyui/$NAME.tar.gz"
    [ -f "$tarball" ] || { echo "comfyui_tree: $tarball not found; set COMFYUI_DIR to a checkout of the $NAME base" >&2; exit 2; }
    rm -rf "$dir"
    mkdir -p "$root/.comfyui"
    tar -xzf "$tarball" -C "$root/.comfyui"
    # the stamp lies outside the tree, so the tree's git commit holds exactly the tarball's files
    touch "$root/.comfyui/$NAME.complete"
  fi
fi
[ -f "$dir/comfy/model_patcher.py" ] || { echo "comfyui_tree: $dir is not a ComfyUI tree (no comfy/model_patcher.py)" >&2; exit 2; }
if [ ! -d "$dir/.git" ]; then
  # a fixed identity and date: the same tarball gives the same commit everywhere
  git -C "$dir" init -q
  git -C "$dir" add -A -f  # -f: the tarball's placeholder files under models/, input/... are tracked upstream
  GIT_AUTHOR_NAME=base GIT_AUTHOR_EMAIL=base@localhost GIT_COMMITTER_NAME=base GIT_COMMITTER_EMAIL=base@localhost \
    GIT_AUTHOR_DATE=2026-01-01T00:00:00Z GIT_COMMITTER_DATE=2026-01-01T00:00:00Z \
    git -C "$dir" -c commit.gpgsign=false commit -q -m "$NAME base"
fi
stamp="$("$py" -c 'import sys; print(sys.prefix)')/.h3sp-comfyui-requirements.sha256"
want=$(sha256sum "$root/requirements-comfyui.txt" | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # a python that already imports them (a GPU machine's ComfyUI install) is left alone: it may have no network
  if ! "$py" -c 'import comfy_aimdo, torchsde, transformers, sentencepiece, scipy, psutil, yaml, PIL, simpleeval, blake3, aiohttp, av, requests, alembic, sqlalchemy, pydantic, safetensors, einops, comfy_kitchen' 2>/dev/null; then
    "$py" -m pip install -q -r "$root/requirements-comfyui.txt" >&2
    echo "$want" > "$stamp"
  fi
fi
echo "$dir"
