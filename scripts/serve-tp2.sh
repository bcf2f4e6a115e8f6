#!/usr/bin/env bash
# Serve a model on two GPUs: `tandem serve MODEL_DIR --tp 2 --device cuda` plus any flags you add.
#
#   scripts/serve-tp2.sh /models/Qwen3.6-27B
#   scripts/serve-tp2.sh /models/Qwen3.6-27B --port 8000 --zmq-endpoint tcp://127.0.0.1:5557 --max-concurrency 8
#
# Environment:
#   GPUS            the two GPUs to use, as CUDA_VISIBLE_DEVICES (default 0,1); rank r runs on the r-th
#   TANDEM          the tandem executable (default: the repository's .venv/bin/tandem, else `tandem` on PATH)
#   TANDEM_API_KEY  when set, every API request must carry it (Authorization: Bearer or x-api-key)
#
# Defaults added before your flags (a flag you give wins): --host 127.0.0.1 --port 8080.
# The script execs tandem, so Ctrl-C / SIGTERM reach it directly and its exit status is the script's:
# 0 after a signal, 1 when the engine failed while serving, 2 for bad flags or an unloadable model.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 MODEL_DIR [tandem serve flags...]" >&2
    exit 2
fi
model_dir=$1
shift
if [[ ! -f "$model_dir/config.json" ]]; then
    echo "$0: $model_dir has no config.json (expected a Hugging Face model directory)" >&2
    exit 2
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tandem=${TANDEM:-}
if [[ -z "$tandem" ]]; then
    if [[ -x "$repo/.venv/bin/tandem" ]]; then
        tandem="$repo/.venv/bin/tandem"
    else
        tandem=$(command -v tandem || true)
    fi
fi
if [[ -z "$tandem" ]]; then
    echo "$0: no tandem executable: run scripts/venv.sh, or set TANDEM=/path/to/tandem" >&2
    exit 2
fi

export CUDA_VISIBLE_DEVICES=${GPUS:-0,1}
IFS=, read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"
if [[ ${#gpus[@]} -ne 2 ]]; then
    echo "$0: GPUS must name two devices, got '$CUDA_VISIBLE_DEVICES'" >&2
    exit 2
fi
if command -v nvidia-smi > /dev/null; then
    for g in "${gpus[@]}"; do
        if ! nvidia-smi -i "$g" --query-gpu=name --format=csv,noheader > /dev/null 2>&1; then
            echo "$0: GPU $g is not visible to nvidia-smi" >&2
            exit 2
        fi
    done
else
    echo "$0: warning: nvidia-smi not found; not checking GPUS=$CUDA_VISIBLE_DEVICES" >&2
fi

exec "$tandem" serve "$model_dir" --tp 2 --device cuda --host 127.0.0.1 --port 8080 "$@"
