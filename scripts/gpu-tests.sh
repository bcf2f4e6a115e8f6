#!/usr/bin/env bash
# The GPU test suite (pytest tests marked `gpu`) on a machine with CUDA devices, with a short log.
#
#   scripts/gpu-tests.sh [LOG_DIR] [pytest args and test files...]
#
# Writes LOG_DIR/gpu-tests.log (full output) and LOG_DIR/gpu-tests.xml (junit), and prints the
# per-test outcomes and the device. Exit status is pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${1:-out}
shift || true
# default: every test module that holds gpu tests (the API tests need client SDKs a GPU box may lack)
if [ $# -eq 0 ] || [ "${1#-}" != "$1" ]; then set -- "$@" $(grep -l "mark.gpu\|@gpu" tests/test_*.py); fi
mkdir -p "$LOG_DIR"
# the checkout's venv (scripts/venv.sh) when there is one, else the python on PATH (a GPU image's)
PY=${PYTHON:-python}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
{
  # TANDEM_COMMIT names the tree when the checkout's git metadata is not the tree's own (a copy)
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  commit: ${TANDEM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__)"
} | tee "$LOG_DIR/gpu-tests.log"
"$PY" -m pytest -m gpu -q -rA -p no:cacheprovider --junitxml="$LOG_DIR/gpu-tests.xml" "$@" 2>&1 \
  | tee -a "$LOG_DIR/gpu-tests.log"
exit "${PIPESTATUS[0]}"
