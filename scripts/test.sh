#!/usr/bin/env bash
# The test command: set up the environment, lint with ComfyUI's ruff rules, run tests-unit.
# Extra arguments go to pytest (e.g. scripts/test.sh -m "not slow" -k layout).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$root/scripts/setup_env.sh")
cd "$root"
"$py" -m ruff check --quiet .
exec "$py" -m pytest -q "$@"
