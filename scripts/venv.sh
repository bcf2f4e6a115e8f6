#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and install tandem into it.
#   scripts/venv.sh          runtime dependencies
#   scripts/venv.sh test     plus the test dependencies (pytest, transformers, API clients)
# Needs only python3 >= 3.11 with venv. Set TANDEM_VENV to use another directory.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TANDEM_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# Install torch on its own first: pinned, so pip does not pull a different (multi-GB) build
# through another package's requirement.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q "torch==${TANDEM_TORCH_VERSION:-2.13.0}"
fi
if [ "${1:-}" = "test" ]; then
    "$VENV/bin/python" -m pip install -q -e ".[test]"
else
    "$VENV/bin/python" -m pip install -q -e .
fi
echo "tandem installed in $VENV"
