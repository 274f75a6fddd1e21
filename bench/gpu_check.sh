#!/usr/bin/env bash
# The vLLM paths on a CUDA GPU, in under 8 minutes: tests/vllm in full — VllmEngine sampling, logprobs and
# structured outputs, in-place weight sync (full and LoRA), a colocate training run, a server-mode training run
# (`grpokit rollout --engine vllm`), sleep levels 1 and 2, bfloat16; and grpokit's own decode loop on CUDA.
#
# Needs a Python that has grpokit's dependencies and a CUDA build of vLLM (`pip install 'grpokit[vllm]'`); pick it
# with PYTHON=/path/to/python (default python3). Extra arguments go to pytest. Exit 2: no GPU or no vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device from $PY" >&2; exit 2
fi
if ! "$PY" -c "import vllm" 2>/dev/null; then
    echo "gpu_check: $PY cannot import vllm; pip install 'grpokit[vllm]' (or set PYTHON=...)" >&2; exit 2
fi
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
timeout 60 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_fast_decode.py  # grpokit's decode loop
timeout 470 "$PY" -m pytest -q -m vllm -p no:cacheprovider -s --durations=10 tests/vllm "$@"
echo "gpu_check: passed in $(( $(date +%s) - start )) s"
