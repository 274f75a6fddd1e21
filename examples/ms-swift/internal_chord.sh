# Port of ms-swift examples/train/grpo/internal/chord.sh (ms-swift 3602360a5), run by
# tests/integration/test_swift_examples.py. Changed, nothing else: swift rlhf --rlhf_type grpo → grpokit train,
# swift rollout → grpokit rollout; --model/--dataset/--chord_sft_dataset (MODEL, DATASET; defaults: the original hub ids);
# CUDA_VISIBLE_DEVICES/NPROC_PER_NODE dropped: one CPU process, so --per_device_train_batch_size is x8 to keep the global batch;
# lengths and steps shrunk (max_completion_length, max_length, vllm_max_model_len, logging_steps, --max_steps 2);
# the server host and port (HOST, PORT), plugin (PLUGIN) and system-prompt file (EXAMPLES) paths are variables.

export CHORD_SYSTEM_PROMPT="You are a helpful assistant that solves MATH problems.
You should first think about the reasoning process in mind and then provide the user with the answer.
You should present your reasoning process using the format: <think>\n...your reasoning process here... </think>\n"

grpokit train \
    --model "${MODEL:-Qwen/Qwen2.5-7B-Instruct}" \
    --dataset "${DATASET:-AI-MO/NuminaMath-TIR}" \
    --load_from_cache_file true \
    --torch_dtype bfloat16 \
    --beta 0.0 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 32 \
    --gradient_accumulation_steps 8 \
    --chord_sft_per_device_train_batch_size 1 \
    --chord_sft_dataset "${DATASET:-AI-MO/NuminaMath-TIR}" \
    --chord_enable_phi_function false \
    --chord_mu_warmup_steps 0 \
    --chord_mu_decay_steps 200 \
    --chord_mu_peak 0.9 \
    --chord_mu_valley 0.05 \
    --num_generations 8 \
    --tuner_type full \
    --reward_funcs accuracy \
    --system "$CHORD_SYSTEM_PROMPT" \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.4 \
    --vllm_max_model_len 1024 \
    --max_completion_length 16 \
    --overlong_filter true \
    --offload_optimizer true \
    --offload_model true \
    --sleep_level 1 \
    --save_steps 1000 \
    --learning_rate 1e-6 \
    --save_total_limit 2 \
    --logging_steps 1 \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --deepspeed zero3 \
    --log_completions true \
    --report_to tensorboard swanlab \
    --max_steps 2
