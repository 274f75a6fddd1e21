# Port of ms-swift examples/train/grpo/external/vllm_multi_turn.sh (ms-swift 3602360a5), run by
# tests/integration/test_swift_examples.py. Changed, nothing else: swift rlhf --rlhf_type grpo → grpokit train,
# swift rollout → grpokit rollout; --model/--dataset (MODEL, DATASET; defaults: the original hub ids);
# CUDA_VISIBLE_DEVICES/NPROC_PER_NODE dropped: one CPU process, so --per_device_train_batch_size is x2 to keep the global batch;
# lengths and steps shrunk (max_completion_length, max_length, vllm_max_model_len, logging_steps, --max_steps 2);
# the server host and port (HOST, PORT), plugin (PLUGIN) and system-prompt file (EXAMPLES) paths are variables.

# grpokit rollout \
#     --model "${MODEL:-Qwen/Qwen3-1.7B}" \
#     --vllm_use_async_engine true \
#     --multi_turn_scheduler thinking_tips_scheduler \
#     --vllm_max_model_len 1024 \
#     --vllm_gpu_memory_utilization 0.8 \
#     --max_turns 3

grpokit train \
    --model "${MODEL:-Qwen/Qwen3-1.7B}" \
    --tuner_type full \
    --external_plugins "${PLUGIN:-examples/train/grpo/plugin/plugin.py}" \
    --reward_funcs thinking_tips \
    --loss_scale last_round \
    --use_vllm true \
    --vllm_mode server \
    --vllm_server_host "${HOST:-127.0.0.1}" \
    --vllm_server_port "${PORT:-8000}" \
    --vllm_server_pass_dataset true \
    --torch_dtype bfloat16 \
    --dataset "${DATASET:-AI-MO/NuminaMath-TIR#10000}" \
    --load_from_cache_file true \
    --split_dataset_ratio 0 \
    --max_completion_length 16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 4 \
    --learning_rate 1e-6 \
    --gradient_accumulation_steps 4 \
    --steps_per_generation 8 \
    --gradient_checkpointing_kwargs '{"use_reentrant": false}' \
    --save_total_limit 2 \
    --logging_steps 1 \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --dataset_num_proc 4 \
    --num_generations 8 \
    --temperature 1.0 \
    --deepspeed zero2 \
    --log_completions true \
    --log_entropy true \
    --importance_sampling_level sequence \
    --top_entropy_quantile 0.2 \
    --num_iterations 1 \
    --report_to tensorboard swanlab \
    --max_steps 2
