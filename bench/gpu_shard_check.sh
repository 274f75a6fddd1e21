#!/usr/bin/env bash
# --fsdp (FSDP2) and --deepspeed zero3 on CUDA GPUs, in under 8 minutes: 2 processes over NCCL train a random
# ~0.5B Qwen3 (hidden 1536, 24 layers, built offline) for 3 steps each, full weights with a reference model
# (beta 0.04) in bf16, then LoRA; prints each run's peak GPU memory per rank and the mean step time. The CPU
# correctness checks of the same code paths are tests/integration/test_sharded_*.py. vLLM colocate weight sync
# is bench/gpu_check.sh's (tests/vllm).
#
# Needs 2 CUDA GPUs (NCCL cannot put two ranks on one GPU) and a Python with grpokit's dependencies and the
# deepspeed extra (`pip install 'grpokit[deepspeed]'`); pick it with PYTHON=/path/to/python (default python3).
# Exit 2: fewer than 2 GPUs or no deepspeed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
    echo "gpu_shard_check: needs 2 CUDA GPUs, $PY sees $gpus" >&2; exit 2
fi
if ! "$PY" -c "import deepspeed" 2>/dev/null; then
    echo "gpu_shard_check: $PY cannot import deepspeed; pip install 'grpokit[deepspeed]'" >&2; exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
"$PY" -c "from grpokit.testing import build_tiny_model; build_tiny_model('$work/model', hidden_size=1536, num_layers=24)"
# a varied reward (the random model never answers right) and the peak memory of each rank, written at the end
cat > "$work/gpu_plugin.py" <<'PLUGIN'
import json
import os

import torch

from grpokit.rewards import ORM, orms
from grpokit.trainers.factory import TrainerFactory
from grpokit.trainers.grpo_trainer import GRPOTrainer


class TokenSum(ORM):
    def __call__(self, completions, completion_ids, **kwargs):
        return [float(sum(ids) % 11) / 11 for ids in completion_ids]


class PeakMemory(GRPOTrainer):
    def _finish(self):
        peak = torch.cuda.max_memory_allocated() / 2**30
        with open(os.path.join(self.args.output_dir, f"peak_rank{self.accelerator.process_index}.json"), "w") as f:
            json.dump({"peak_gib": round(peak, 2)}, f)
        super()._finish()


orms["token_sum"] = TokenSum
TrainerFactory.TRAINER_MAPPING["grpo"] = "gpu_plugin.PeakMemory"
PLUGIN
run() {  # name, extra options...
    local name=$1; shift
    local t0 port; t0=$(date +%s)
    port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    timeout 90 "$PY" -m torch.distributed.run --nproc_per_node 2 --master_port "$port" \
        -m grpokit train --model "$work/model" --dataset builtin:arithmetic --reward_funcs token_sum \
        --external_plugins "$work/gpu_plugin.py" --max_steps 3 --num_generations 4 \
        --per_device_train_batch_size 8 --max_completion_length 64 --torch_dtype bfloat16 \
        --output_dir "$work/$name" --disable_tqdm true --plots false --save_steps 2 "$@" > "$work/$name.log" 2>&1 \
        || { tail -40 "$work/$name.log"; echo "gpu_shard_check: $name FAILED" >&2; exit 1; }
    "$PY" - "$work/$name" "$name" "$(( $(date +%s) - t0 ))" <<'REPORT'
import json, sys
from pathlib import Path
out, name, wall = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
steps = [r for r in rows if "loss" in r]
assert len(steps) == 3, f"{name}: {len(steps)} logged steps"
step_s = sum(r.get("timing/train", 0) + r.get("timing/rollout", 0) for r in steps) / len(steps)
peaks = [json.loads(p.read_text())["peak_gib"] for p in sorted(out.glob("peak_rank*.json"))]
print(f"{name}: 3 steps, {step_s:.2f} s/step (rollout+train), peak GPU memory per rank {peaks} GiB, "
      f"{wall} s with start-up; loss {[r['loss'] for r in steps]}")
final = out / "final_model"  # a full model folder, or a LoRA adapter folder
assert (final / "config.json").is_file() or (final / "adapter_config.json").is_file(), f"{name}: no final model"
assert (out / "checkpoint-2").is_dir(), f"{name}: no checkpoint"
REPORT
}
run ddp --beta 0.04
run fsdp --beta 0.04 --fsdp true
run zero3 --beta 0.04 --deepspeed zero3
run fsdp_lora --fsdp true --tuner_type lora --target_modules all-linear
run zero3_lora --deepspeed zero3 --tuner_type lora --target_modules all-linear
echo "gpu_shard_check: passed in $(( $(date +%s) - start )) s"
