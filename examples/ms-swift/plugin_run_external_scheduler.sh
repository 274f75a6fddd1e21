# Port of ms-swift examples/train/grpo/plugin/run_external_scheduler.sh (ms-swift 3602360a5), run by
# tests/integration/test_swift_examples.py. Changed, nothing else: swift rlhf --rlhf_type grpo → grpokit train,
# swift rollout → grpokit rollout; --model/--dataset (MODEL, DATASET; defaults: the original hub ids);
# CUDA_VISIBLE_DEVICES/NPROC_PER_NODE dropped: one CPU process, so --per_device_train_batch_size is x3 to keep the global batch;
# lengths and steps shrunk (max_completion_length, max_length, vllm_max_model_len, logging_steps, --max_steps 2);
# the server host and port (HOST, PORT), plugin (PLUGIN) and system-prompt file (EXAMPLES) paths are variables.

# grpokit rollout \
#     --model "${MODEL:-Qwen/Qwen2.5-7B-Instruct}" \
#     --vllm_use_async_engine true \
#     --external_plugins "${PLUGIN:-examples/train/grpo/plugin/plugin.py}" \
#     --multi_turn_scheduler tool_call_scheduler \
#     --vllm_max_model_len 1024 \
#     --vllm_gpu_memory_utilization 0.8 \
#     --max_turns 5

SYSTEM_PROMPT='
Answer the following questions as best you can. You have access to the following tools:

calculator
Purpose: Perform basic arithmetic (+, -, *, /, parentheses) and return the result as text.
Input (single string): the math expression to evaluate, e.g. "2*(3+4)".
Only digits, spaces, and the characters +-*/(). are allowed.

Use the following format:

Question: the input question you must answer
Thought: you should always think about what to do
Action: the action to take, should be one of [calculator]
Action Input: the input to the action
Observation: the result of the action
... (this Thought/Action/Action Input/Observation can be repeated zero or more times)
Thought: I now know the final answer
Final Answer: the final answer to the original input question, the answer should be written as \(\boxed{<answer>}\), e.g. \(\boxed{10}\)

Begin!
'

grpokit train \
    --model "${MODEL:-Qwen/Qwen2.5-7B-Instruct}" \
    --reward_funcs accuracy \
    --tuner_type full \
    --torch_dtype bfloat16 \
    --use_vllm true \
    --vllm_mode server \
    --vllm_server_host "${HOST:-127.0.0.1}" \
    --vllm_server_port "${PORT:-8000}" \
    --dataset "${DATASET:-AI-MO/NuminaMath-TIR#1000}" \
    --load_from_cache_file true \
    --max_completion_length 16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 3 \
    --learning_rate 1e-5 \
    --gradient_accumulation_steps 4 \
    --eval_steps 100 \
    --save_steps 100 \
    --save_total_limit 2 \
    --logging_steps 1 \
    --output_dir output \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --dataset_num_proc 4 \
    --num_generations 4 \
    --temperature 0.9 \
    --system "$SYSTEM_PROMPT" \
    --log_completions true \
    --deepspeed zero3 \
    --stop_words "Observation:" \
    --report_to swanlab tensorboard \
    --max_steps 2
