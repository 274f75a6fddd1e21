#!/usr/bin/env bash
# DeepSpeed ZeRO-3, FSDP2, DDP and vLLM colocate weight sync on CUDA GPUs, in under 8 minutes on one GPU: a random
# ~0.44B Qwen3 (Qwen3-0.6B's body, the tiny offline tokenizer: no hub) trains 3 steps per part in bf16. Each part
# prints one line, `RESULT <part> PASS|FAIL|SKIP: ...`, with the step time, each rank's peak torch GPU memory
# (torch.cuda.max_memory_allocated) and the GPU's peak used memory seen by nvidia-smi (all processes); the script
# exits 1 when a part failed, after running the others. Parts:
#   one GPU or more: ddp (one plain process, beta 0.04), zero3 (--deepspeed zero3 in one process, no launcher,
#     beta 0.04), zero3_lora, fsdp (--fsdp in one process: FSDP2's code path, nothing split), vllm_colocate
#     (--use_vllm true: after every weight sync vLLM's embedding matrix must equal the policy's; SKIP without vllm);
#   two GPUs or more, also: ddp_2proc, fsdp_2proc, zero3_2proc, fsdp_lora_2proc, zero3_lora_2proc (torchrun, NCCL).
#
# Usage: bash bench/gpu_shard_check.sh [--cpu-dry-run] [--only part,part]
#   --cpu-dry-run  the same parts on CPU with a 2-layer model, 2 steps each and gloo for the 2-process parts, to
#                  check the script's logic on a machine without GPUs (vllm_colocate needs vllm in PYTHON).
# Needs a Python with grpokit's dependencies and the deepspeed extra (`pip install 'grpokit[deepspeed]'`; vLLM for
# its part); pick it with PYTHON=/path/to/python (default python3). Runs go to a temporary folder, each removed
# after its report (a 0.44B run's checkpoints take several GB); with $OUT set (the device tool brings back a few
# files) the result lines go to $OUT/gpu_shard_check_results.txt and the end of every part's log to
# $OUT/gpu_shard_check_logs.txt, as each part ends. Without deepspeed (or vllm) those parts are SKIP.
# Exit 2: no GPU (and no --cpu-dry-run), or a bad argument.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
dry=0 only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-dry-run) dry=1 ;;
        --only) only="${2:?--only needs a comma-separated list of parts}"; shift ;;
        *) echo "gpu_shard_check: unknown argument $1 (use --cpu-dry-run, --only part,part)" >&2; exit 2 ;;
    esac
    shift
done
PARTS=",ddp,zero3,zero3_lora,fsdp,vllm_colocate,ddp_2proc,fsdp_2proc,zero3_2proc,fsdp_lora_2proc,zero3_lora_2proc,"
for name in ${only//,/ }; do
    [[ "$PARTS" == *",$name,"* ]] \
        || { echo "gpu_shard_check: --only $name: no such part; parts: ${PARTS:1:-1}" >&2; exit 2; }
done
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())") \
    || { echo "gpu_shard_check: $PY cannot import torch" >&2; exit 2; }
if [ "$dry" = 1 ]; then
    gpus=0 nproc_max=2 steps=2 dtype=float32 limit=600 model_flag=--tiny
    export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES="" VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=auto
elif [ "$gpus" -lt 1 ]; then
    echo "gpu_shard_check: $PY sees no CUDA GPU; run on a GPU machine, or pass --cpu-dry-run" >&2; exit 2
else
    nproc_max=$(( gpus >= 2 ? 2 : 1 )) steps=3 dtype=bfloat16 limit=150 model_flag=""
fi
has() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
[ "$gpus" -gt 0 ] && { nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
results="${OUT:+$OUT/gpu_shard_check_results.txt}" logs="${OUT:+$OUT/gpu_shard_check_logs.txt}"
results="${results:-$work/results.txt}" logs="${logs:-/dev/null}"
start=$(date +%s) failed=0
"$PY" bench/gpu_check_plugin.py model "$work/model" $model_flag \
    || { echo "gpu_shard_check: building the model failed" >&2; exit 1; }

wanted() { [ -z "$only" ] || [[ ",$only," == *",$1,"* ]]; }
result() { echo "$*" | tee -a "$results"; }

smi_peak() {  # sample the GPUs' used memory every second into $1 until killed
    while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits >> "$1" 2>/dev/null; sleep 1; done
}

part() {  # name, processes, extra options...
    local name=$1 nproc=$2; shift 2
    wanted "$name" || return 0
    local out="$work/$name" t0 sampler="" launch
    t0=$(date +%s)
    rm -rf "$out"
    if [ "$nproc" -gt 1 ]; then
        local port
        port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
        launch=("$PY" -m torch.distributed.run --nproc_per_node "$nproc" --master_addr 127.0.0.1 --master_port "$port")
    else
        launch=("$PY")  # one process, no launcher: --deepspeed forms a one-process group of its own
    fi
    [ "$gpus" -gt 0 ] && { smi_peak "$work/$name.smi" & sampler=$!; }
    timeout "$limit" env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u MASTER_ADDR -u MASTER_PORT "${launch[@]}" \
        -m grpokit train --model "$work/model" --dataset builtin:arithmetic --reward_funcs token_sum \
        --external_plugins bench/gpu_check_plugin.py --max_steps "$steps" --num_generations 4 \
        --per_device_train_batch_size 8 --max_completion_length 64 --torch_dtype "$dtype" --logging_steps 1 \
        --output_dir "$out" --disable_tqdm true --plots false --save_steps 2 "$@" > "$work/$name.log" 2>&1
    local rc=$?
    [ -n "$sampler" ] && { kill "$sampler"; wait "$sampler" 2>/dev/null; }
    local wall=$(( $(date +%s) - t0 )) smi=""
    [ -s "$work/$name.smi" ] && smi=", nvidia-smi peak used $(sort -n "$work/$name.smi" | tail -1) MiB"
    { echo "===== $name (exit $rc, $wall s): the end of its log"; tail -300 "$work/$name.log"; } >> "$logs"
    if [ "$rc" -ne 0 ]; then
        tail -30 "$work/$name.log"
        local why="exit $rc"; [ "$rc" = 124 ] && why="timed out after $limit s"
        result "RESULT $name FAIL: $why ($wall s)"
        failed=1
    else
        local line; line=$("$PY" bench/gpu_check_plugin.py report "$out" "$name" "$wall") || failed=1
        result "$line$smi"
    fi
    rm -rf "$out"
}

skip() { wanted "$1" && result "RESULT $1 SKIP: $2"; return 0; }

FULL=(--beta 0.04)
LORA=(--beta 0 --tuner_type lora --lora_rank 16 --lora_alpha 32 --target_modules all-linear)
part ddp 1 "${FULL[@]}"
if has deepspeed; then
    part zero3 1 "${FULL[@]}" --deepspeed zero3
    part zero3_lora 1 "${LORA[@]}" --deepspeed zero3
else
    for name in zero3 zero3_lora zero3_2proc zero3_lora_2proc; do
        skip "$name" "$PY cannot import deepspeed (pip install 'grpokit[deepspeed]')"
    done
fi
part fsdp 1 "${FULL[@]}" --fsdp true
if has vllm; then
    limit=$(( limit + 90 )) part vllm_colocate 1 --beta 0 --learning_rate 1e-3 --use_vllm true --vllm_mode colocate \
        --vllm_gpu_memory_utilization 0.3 --vllm_max_model_len 1024 --vllm_enforce_eager true
else
    skip vllm_colocate "$PY cannot import vllm (pip install 'grpokit[vllm]')"
fi
if [ "$nproc_max" -ge 2 ]; then
    part ddp_2proc 2 "${FULL[@]}"
    part fsdp_2proc 2 "${FULL[@]}" --fsdp true
    part fsdp_lora_2proc 2 "${LORA[@]}" --fsdp true
    if has deepspeed; then
        part zero3_2proc 2 "${FULL[@]}" --deepspeed zero3
        part zero3_lora_2proc 2 "${LORA[@]}" --deepspeed zero3
    fi
else
    for name in ddp_2proc fsdp_2proc zero3_2proc fsdp_lora_2proc zero3_lora_2proc; do
        skip "$name" "needs 2 GPUs (NCCL cannot put two ranks on one GPU), $gpus here"
    done
fi
status=$([ "$failed" = 0 ] && echo passed || echo FAILED)
echo "gpu_shard_check: $status in $(( $(date +%s) - start )) s${OUT:+ (results: $results)}" | tee -a "$results"
exit "$failed"
