#!/usr/bin/env bash
# The CPU test suite, in the project's virtual environment (created on first use).
# Extra arguments go to pytest, e.g. scripts/run-tests.sh -k parity -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh test
exec "${TANDEM_VENV:-.venv}/bin/python" -m pytest -q "$@"
