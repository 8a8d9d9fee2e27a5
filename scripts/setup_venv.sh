#!/usr/bin/env bash
# Creates .venv with Python 3.12 (jax 0.12 needs it) and installs this project.
# Usage: scripts/setup_venv.sh [EXTRAS]   e.g. scripts/setup_venv.sh test,bench
set -euo pipefail
cd "$(dirname "$0")/.."

find_python312() {
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c '' 2>/dev/null; then
    echo python3.12; return
  fi
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 \
                   /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if [ -x "$candidate" ]; then echo "$candidate"; return; fi
  done
  echo "setup_venv: no Python 3.12 found (install it, e.g. with pyenv)" >&2
  exit 1
}

VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$(find_python312)" -m venv "$VENV"
"$VENV/bin/python" -m pip install -qq --upgrade pip
if [ -n "${1:-}" ]; then
  "$VENV/bin/python" -m pip install -qq -e ".[$1]"
else
  "$VENV/bin/python" -m pip install -qq -e .
fi
