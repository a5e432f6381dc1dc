#!/usr/bin/env bash
# The main job: set up the environment, then run MiniMax H3 sequence parallelism end to end
# (defaults: a small generated H3 checkpoint, 2 CPU ranks). Arguments go to the script (--help).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$root/scripts/setup_env.sh")
cd "$root"
exec "$py" scripts/h3_sequence_parallel.py "$@"
