# Port of ms-swift examples/train/grpo/plugin/gsm8k/gsm8k.sh (ms-swift 3602360a5), run by
# tests/integration/test_swift_examples.py. Changed, nothing else: swift rlhf --rlhf_type grpo → grpokit train,
# swift rollout → grpokit rollout; --model/--dataset (MODEL, DATASET; defaults: the original hub ids);
# CUDA_VISIBLE_DEVICES/NPROC_PER_NODE dropped: one CPU process, so --per_device_train_batch_size is x4 to keep the global batch;
# lengths and steps shrunk (max_completion_length, max_length, vllm_max_model_len, logging_steps, --max_steps 2);
# the server host and port (HOST, PORT), plugin (PLUGIN) and system-prompt file (EXAMPLES) paths are variables.

SYSTEM_PROMPT="""You are a helpful math assistant. Solve the problem step by step and put your final answer within \\boxed{}."""

grpokit train \
    --model "${MODEL:-Qwen/Qwen3.5-2B}" \
    --external_plugins "${PLUGIN:-examples/train/grpo/plugin/gsm8k/gsm8k_plugin.py}" \
    --reward_funcs gsm8k_accuracy gsm8k_format \
    --columns '{"answer": "solution"}' \
    --enable_thinking false \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.4 \
    --vllm_tensor_parallel_size 1 \
    --vllm_max_model_len 1024 \
    --sleep_level 1 \
    --tuner_type full \
    --torch_dtype bfloat16 \
    --dataset "${DATASET:-modelscope/gsm8k}" \
    --load_from_cache_file true \
    --max_length 512 \
    --max_completion_length 16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 16 \
    --gradient_accumulation_steps 4 \
    --learning_rate 1e-6 \
    --lr_scheduler_type cosine \
    --save_steps 10 \
    --save_total_limit 100 \
    --logging_steps 1 \
    --warmup_ratio 0.0 \
    --dataloader_num_workers 4 \
    --num_generations 8 \
    --temperature 1.0 \
    --system "$SYSTEM_PROMPT" \
    --deepspeed zero2 \
    --log_completions true \
    --report_to tensorboard swanlab \
    --max_grad_norm 1.0 \
    --epsilon 0.2 \
    --epsilon_high 0.28 \
    --scale_rewards none \
    --max_steps 2
