# Port of ms-swift examples/train/grpo/external/agent.sh (ms-swift 3602360a5), run by
# tests/integration/test_swift_examples.py. Changed, nothing else: swift rlhf --rlhf_type grpo → grpokit train,
# swift rollout → grpokit rollout; --model/--dataset (MODEL, DATASET; defaults: the original hub ids);
# CUDA_VISIBLE_DEVICES/NPROC_PER_NODE dropped: one CPU process, so --per_device_train_batch_size is x7 to keep the global batch;
# lengths and steps shrunk (max_completion_length, max_length, vllm_max_model_len, logging_steps, --max_steps 2);
# the server host and port (HOST, PORT), plugin (PLUGIN) and system-prompt file (EXAMPLES) paths are variables (--vllm_server_port added with ms-swift's default 8000).

# WANDB_API_KEY=xxx \

# grpokit rollout \
#     --model "${MODEL:-Qwen/Qwen2.5-7B}"

grpokit train \
    --model "${MODEL:-Qwen/Qwen2.5-7B}" \
    --tuner_type full \
    --dataset "${DATASET:-LLM-Research/xlam-function-calling-60k:grpo}" \
    --load_from_cache_file true \
    --use_vllm true \
    --vllm_mode server \
    --vllm_server_host "${HOST:-127.0.0.1}" \
    --vllm_server_port "${PORT:-8000}" \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --max_length 512 \
    --per_device_train_batch_size 49 \
    --per_device_eval_batch_size 7 \
    --eval_steps 2000 \
    --save_steps 2000 \
    --learning_rate 1e-6 \
    --save_total_limit 2 \
    --logging_steps 1 \
    --output_dir output \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --max_completion_length 16 \
    --reward_funcs toolbench react_format \
    --num_generations 49 \
    --deepspeed zero3 \
    --temperature 1.0 \
    --stop_words Observation: \
    --agent_template react_grpo \
    --top_p 0.85 \
    --top_k 50 \
    --log_completions true \
    --report_to wandb \
    --max_steps 2
