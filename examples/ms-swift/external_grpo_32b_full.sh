# Port of ms-swift examples/train/grpo/external/grpo_32b_full.sh (ms-swift 3602360a5), run by
# tests/integration/test_swift_examples.py. Changed, nothing else: swift rlhf --rlhf_type grpo → grpokit train,
# swift rollout → grpokit rollout; --model/--dataset (MODEL, DATASET; defaults: the original hub ids);
# CUDA_VISIBLE_DEVICES/NPROC_PER_NODE dropped: one CPU process, so --per_device_train_batch_size is x8 to keep the global batch;
# lengths and steps shrunk (max_completion_length, max_length, vllm_max_model_len, logging_steps, --max_steps 2);
# the server host and port (HOST, PORT), plugin (PLUGIN) and system-prompt file (EXAMPLES) paths are variables.

# grpokit rollout \
#     --model "${MODEL:-Qwen/Qwen2.5-32B-Instruct}" \
#     --vllm_tensor_parallel_size 2

grpokit train \
    --model "${MODEL:-Qwen/Qwen2.5-32B-Instruct}" \
    --reward_funcs accuracy \
    --use_vllm true \
    --vllm_mode server \
    --vllm_server_host "${HOST:-xxx}" \
    --vllm_server_port "${PORT:-8000}" \
    --tuner_type full \
    --torch_dtype bfloat16 \
    --dataset "${DATASET:-AI-MO/NuminaMath-TIR#1000}" \
    --load_from_cache_file true \
    --split_dataset_ratio 0 \
    --max_completion_length 16 \
    --num_train_epochs 3 \
    --per_device_train_batch_size 8 \
    --learning_rate 1e-6 \
    --gradient_accumulation_steps 1 \
    --save_total_limit 2 \
    --logging_steps 1 \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --dataset_num_proc 4 \
    --num_generations 8 \
    --temperature 1.0 \
    --top_p 0.9 \
    --top_k 50 \
    --deepspeed zero3 \
    --log_completions true \
    --num_iterations 1 \
    --report_to tensorboard wandb \
    --beta 0.0 \
    --max_steps 2
