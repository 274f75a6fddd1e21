#!/usr/bin/env bash
# The vLLM paths on a CUDA GPU, in under 8 minutes: tests/vllm in full — VllmEngine sampling, logprobs and
# structured outputs, in-place weight sync (full and LoRA), a colocate training run, a server-mode training run
# (`grpokit rollout --engine vllm`), sleep levels 1 and 2, bfloat16; and grpokit's own decode loop on CUDA.
#
# Needs a Python that has grpokit's dependencies and a CUDA build of vLLM (`pip install 'grpokit[vllm]'`); pick it
# with PYTHON=/path/to/python (default python3). Extra arguments go to pytest. Exit 2: no GPU or no vLLM.
#
# Optional, BENCH_ASYNC=1 (after the tests) or BENCH_ASYNC=only (instead of them; vLLM not needed): the long-tail
# benchmark of --max_staleness (bench/bench_async.py: sync, K = 1, 2, 4 side by side, docs/PERFORMANCE.md) with a
# real-sized model on this GPU: a random Qwen3 with Qwen3-0.6B's body (bench/gpu_check_plugin.py model; no hub),
# bfloat16, the rollout server (transformers engine, grpokit's decode loop) and the trainer sharing the GPU; about
# 4 minutes. Its table also goes to $OUT/bench_async_gpu.txt when $OUT is set.
#
# Optional, SWIFT_CHECK=1 (after the tests) or SWIFT_CHECK=only (instead of them): ms-swift's rollout protocol on
# this GPU (bench/gpu_swift_check.py; needs ms-swift 4.6 in the same Python): ms-swift's own VLLMClient against
# `grpokit rollout --engine vllm`, grpokit's trainer client against a real `swift rollout`, and with two GPUs the
# NCCL weight push both ways. A few minutes (four vLLM servers start, one after the other).
#
# Optional, BENCH_STEP=1 (after the tests) or BENCH_STEP=only (instead of them; vLLM not needed): the step-time
# table against TRL (bench/bench_step.py, docs/PERFORMANCE.md) on this GPU with a real-sized model: a random Qwen3
# with Qwen3-0.6B's body (bench/gpu_check_plugin.py model; no hub), full fine-tuning, float32, batch 8 of 4
# generations, 64 new tokens, grpokit and TRL alternating for 2 rounds of 4 steps: the per-phase profile (prefill,
# decode, forward, backward, optimizer, sync ...) of both and the ratio. TRL comes from the Python's site-packages,
# else from TRL_PATH (a folder holding trl 1.16.0, e.g. a copy of ~/.cache/grpokit/trl-1.16.0 carried along).
# About 3 minutes. Its table also goes to $OUT/bench_step_gpu.txt when $OUT is set. BENCH_STEP=dry: the same
# commands on the CPU with a 2-layer model and 2 steps, to check the script where no GPU is lent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
step="${BENCH_STEP:-0}"
if [ "$step" = dry ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    "$PY" bench/gpu_check_plugin.py model "$work/model" --tiny
    "$PY" bench/bench_step.py --model "$work/model" --device cpu --threads 1 --steps 2 --rounds 1 --batch 8 \
        --num_generations 4 --max_completion_length 16 --trl_path "${TRL_PATH:-$HOME/.cache/grpokit/trl-1.16.0}" \
        | tee "${OUT:-$work}/bench_step_dry.txt"
    exit 0
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device from $PY" >&2; exit 2
fi
bench="${BENCH_ASYNC:-0}"
swift="${SWIFT_CHECK:-0}"
if [ "$swift" != 0 ] && ! "$PY" -c "import swift.rlhf_trainers.vllm_client" 2>/dev/null; then
    echo "gpu_check: $PY cannot import ms-swift; pip install ms-swift==4.6.0 (or set PYTHON=...)" >&2; exit 2
fi
if [ "$swift" = only ] || [ "$step" = only ]; then bench=skip; fi
if [ "$bench" != only ] && [ "$step" != only ] && ! "$PY" -c "import vllm" 2>/dev/null; then
    echo "gpu_check: $PY cannot import vllm; pip install 'grpokit[vllm]' (or set PYTHON=...)" >&2; exit 2
fi
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
if [ "$bench" != only ] && [ "$swift" != only ] && [ "$step" != only ]; then
    timeout 60 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_fast_decode.py  # grpokit's decode loop
    timeout 470 "$PY" -m pytest -q -m vllm -p no:cacheprovider -s --durations=10 tests/vllm "$@"
    echo "gpu_check: passed in $(( $(date +%s) - start )) s"
fi
if [ "$bench" = 1 ] || [ "$bench" = only ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$PY" bench/gpu_check_plugin.py model "$work/model"
    # 64 completions of at most 256 tokens per step: on a GPU decoding is bound by per-token latency, training by
    # tokens, so a larger batch than on the CPU brings the two closer
    timeout 420 "$PY" bench/bench_async.py --model "$work/model" --device cuda --torch_dtype bfloat16 --pin off \
        --trainer_threads 4 --server_threads 4 --steps 10 --rounds 1 --batch 64 --max_completion_length 256 \
        | tee "${OUT:-$work}/bench_async_gpu.txt"
    echo "gpu_check: bench_async done in $(( $(date +%s) - start )) s"
fi
if [ "$swift" = 1 ] || [ "$swift" = only ]; then
    swift_work=$(mktemp -d)
    timeout 900 "$PY" bench/gpu_swift_check.py "$swift_work"
    rm -rf "$swift_work"
    echo "gpu_check: ms-swift protocol checked in $(( $(date +%s) - start )) s"
fi
if [ "$step" = 1 ] || [ "$step" = only ]; then
    step_work=$(mktemp -d)
    "$PY" bench/gpu_check_plugin.py model "$step_work/model"
    timeout 400 "$PY" bench/bench_step.py --model "$step_work/model" --device cuda --threads 4 --steps 4 --rounds 2 \
        --batch 8 --num_generations 4 --max_completion_length 64 --trl_path "${TRL_PATH:-$PWD/.trl}" \
        | tee "${OUT:-$step_work}/bench_step_gpu.txt"
    rm -rf "$step_work"
    echo "gpu_check: bench_step done in $(( $(date +%s) - start )) s"
fi
