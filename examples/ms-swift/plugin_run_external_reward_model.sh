# Port of ms-swift examples/train/grpo/plugin/run_external_reward_model.sh (ms-swift 3602360a5), run by
# tests/integration/test_swift_examples.py. Changed, nothing else: swift rlhf --rlhf_type grpo → grpokit train,
# swift rollout → grpokit rollout; --model/--dataset (MODEL, DATASET; defaults: the original hub ids);
# CUDA_VISIBLE_DEVICES/NPROC_PER_NODE dropped: one CPU process, so --per_device_train_batch_size is x8 to keep the global batch;
# lengths and steps shrunk (max_completion_length, max_length, vllm_max_model_len, logging_steps, --max_steps 2);
# the server host and port (HOST, PORT), plugin (PLUGIN) and system-prompt file (EXAMPLES) paths are variables;
# so are the two --reward_model folders (JUDGE_MODEL, REWARD_MODEL).

grpokit train \
    --model "${MODEL:-Qwen/Qwen2.5-7B}" \
    --dataset "${DATASET:-AI-MO/NuminaMath-TIR#5000}" \
    --load_from_cache_file true \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.5 \
    --external_plugins "${PLUGIN:-examples/train/grpo/plugin/plugin.py}" \
    --reward_funcs format \
    --reward_model "${JUDGE_MODEL:-Qwen/Qwen2.5-3B-Instruct}" "${REWARD_MODEL:-Shanghai_AI_Laboratory/internlm2-7b-reward}" \
    --reward_model_plugin genrm my_rmplugin \
    --reward_weights 0.1 1 1 \
    --sleep_level 1 \
    --offload_model true \
    --offload_optimizer true \
    --log_completions true \
    --deepspeed zero2 \
    --max_steps 2
