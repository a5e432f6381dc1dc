#!/usr/bin/env bash
# Builds the git-ignored .device/ that bench/device/run.sh unpacks on the GPU machine (bench/README.md,
# "Device runs"): site.zip (the packages the base pins that the machine lacks; comfy_kitchen without its
# HIP library, to stay under the 64 MiB a call may carry) and tree.tar.gz (the patched tree of this
# checkout, patches/build.py --tree). Run from a checkout whose scripts/test.sh set-up is done.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$root/.device" "$work/site"
python3 -m pip download -q --no-deps -d "$work" comfy-kitchen==0.2.31 comfy-aimdo==0.4.13 torchsde trampoline
for w in "$work"/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
rm -rf "$work/site/comfy_kitchen/backends/hip"
rm -f "$root/.device/site.zip"
(cd "$work/site" && zip -qr -9 "$root/.device/site.zip" .)
COMFYUI_DIR="$root/.comfyui/comfyui-h3-newest" "$root/.venv/bin/python" "$root/patches/build.py" --tree "$work/tree" >/dev/null
tar -czf "$root/.device/tree.tar.gz" -C "$work/tree" --exclude=.git .
du -sh "$root/.device"/*
