# Port of ms-swift examples/train/grpo/internal/real.sh (ms-swift 3602360a5), run by
# tests/integration/test_swift_examples.py. Changed, nothing else: swift rlhf --rlhf_type grpo → grpokit train,
# swift rollout → grpokit rollout; --model/--dataset (MODEL, DATASET; defaults: the original hub ids);
# CUDA_VISIBLE_DEVICES/NPROC_PER_NODE dropped: one CPU process, so --per_device_train_batch_size is x2 to keep the global batch;
# lengths and steps shrunk (max_completion_length, max_length, vllm_max_model_len, logging_steps, --max_steps 2);
# the server host and port (HOST, PORT), plugin (PLUGIN) and system-prompt file (EXAMPLES) paths are variables.

grpokit rollout \
    --model "${MODEL:-Qwen/Qwen3-1.7B}"

grpokit train \
    --model "${MODEL:-Qwen/Qwen3-1.7B}" \
    --dataset "${DATASET:-AI-MO/NuminaMath-TIR#5000}"  \
    --enable_thinking false \
    --reward_funcs accuracy \
    --use_vllm true \
    --vllm_mode server \
    --vllm_server_host "${HOST:-127.0.0.1}" \
    --vllm_server_port "${PORT:-8000}" \
    --tuner_type full \
    --torch_dtype bfloat16 \
    --load_from_cache_file true \
    --max_completion_length 16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 16 \
    --learning_rate 2e-6 \
    --gradient_accumulation_steps 1 \
    --save_total_limit 2 \
    --save_steps 500 \
    --logging_steps 1 \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --num_generations 8 \
    --temperature 0.6 \
    --system """You are a helpful math assistant. Solve the problem step by step and put your final answer within \\boxed{}.""" \
    --log_completions true \
    --num_iterations 1 \
    --beta 0.001 \
    --loss_type real \
    --deepspeed zero2 \
    --max_steps 2
