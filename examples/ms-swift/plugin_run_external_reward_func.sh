# Port of ms-swift examples/train/grpo/plugin/run_external_reward_func.sh (ms-swift 3602360a5), run by
# tests/integration/test_swift_examples.py. Changed, nothing else: swift rlhf --rlhf_type grpo → grpokit train;
# --model/--dataset (MODEL, DATASET; defaults: the original hub ids);
# CUDA_VISIBLE_DEVICES/NPROC_PER_NODE dropped: one CPU process, so --per_device_train_batch_size is x4 to keep the global batch;
# PYTORCH_CUDA_ALLOC_CONF dropped (CUDA only); MAX_PIXELS dropped (the processor's own max_pixels applies);
# lengths and steps shrunk (max_completion_length, vllm_max_model_len, logging_steps, --max_steps 2);
# the plugin (PLUGIN) and system-prompt file (EXAMPLES) paths are variables.

grpokit train \
    --model "${MODEL:-Qwen/Qwen2.5-VL-3B-Instruct}" \
    --external_plugins "${PLUGIN:-examples/train/grpo/plugin/plugin.py}" \
    --reward_funcs external_r1v_acc format \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.6 \
    --vllm_tensor_parallel_size 1 \
    --vllm_max_model_len 1024 \
    --tuner_type full \
    --torch_dtype bfloat16 \
    --dataset "${DATASET:-AI-ModelScope/clevr_cogen_a_train}" \
    --overlong_filter false \
    --importance_sampling_level token \
    --epsilon 0.2 \
    --epsilon_high 0.28 \
    --max_completion_length 16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 16 \
    --learning_rate 1e-6 \
    --gradient_accumulation_steps 4 \
    --steps_per_generation 4 \
    --eval_steps 1000 \
    --save_steps 1000 \
    --save_total_limit 10 \
    --sleep_level 1 \
    --offload_model true \
    --offload_optimizer true \
    --logging_steps 1 \
    --dataloader_num_workers 4 \
    --num_generations 8 \
    --temperature 1.0 \
    --system "${EXAMPLES:-examples/ms-swift}/prompt.txt" \
    --deepspeed zero1 \
    --log_completions true \
    --report_to tensorboard swanlab \
    --num_iterations 1 \
    --async_generate false \
    --beta 0.001 \
    --loss_type grpo \
    --vllm_enable_lora false \
    --advantage_estimator grpo \
    --max_steps 2
