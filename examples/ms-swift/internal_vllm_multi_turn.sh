# Port of ms-swift examples/train/grpo/internal/vllm_multi_turn.sh (ms-swift 3602360a5), run by
# tests/integration/test_swift_examples.py. Changed, nothing else: swift rlhf --rlhf_type grpo → grpokit train,
# swift rollout → grpokit rollout; --model/--dataset (MODEL, DATASET; defaults: the original hub ids);
# CUDA_VISIBLE_DEVICES/NPROC_PER_NODE dropped: one CPU process, so --per_device_train_batch_size is x8 to keep the global batch;
# lengths and steps shrunk (max_completion_length, max_length, vllm_max_model_len, logging_steps, --max_steps 2);
# the server host and port (HOST, PORT), plugin (PLUGIN) and system-prompt file (EXAMPLES) paths are variables.

grpokit train \
    --model "${MODEL:-Qwen/Qwen2.5-3B-Instruct}" \
    --tuner_type full \
    --reward_funcs accuracy \
    --dataset "${DATASET:-AI-MO/NuminaMath-TIR#10000}" \
    --load_from_cache_file true \
    --torch_dtype bfloat16 \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.5 \
    --vllm_max_model_len 1024 \
    --vllm_tensor_parallel_size 4 \
    --num_train_epochs 1 \
    --max_length 512 \
    --per_device_train_batch_size 32 \
    --per_device_eval_batch_size 4 \
    --gradient_accumulation_steps 1 \
    --eval_steps 1000 \
    --save_steps 1000 \
    --learning_rate 1e-6 \
    --save_total_limit 2 \
    --logging_steps 1 \
    --output_dir output \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --max_completion_length 16 \
    --num_generations 32 \
    --deepspeed zero3 \
    --temperature 1.0 \
    --top_p 1.0 \
    --top_k 80 \
    --log_completions true \
    --offload_optimizer true \
    --offload_model true \
    --sleep_level 1 \
    --multi_turn_scheduler math_tip_trick \
    --max_turns 3 \
    --max_steps 2
