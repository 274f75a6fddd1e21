"""The reward-function examples of TRL's GRPO documentation, registered through a plugin, for compatibility tests.

Source: huggingface/trl docs/source/grpo_trainer.md at commit f2cd57710ae345ea6428ae95363267fcf38a3dc8, section "Using a custom reward
function", Examples 1 to 6. Each example's imports and function definitions are copied unmodified (Example 4's
dataset and GRPOTrainer lines are left out: a plugin registers functions, it does not train). After each example
one line registers its function(s) in grpokit's ``orms``. Example 4 calls ``check_math_solution`` and
``test_code_solution``, which the documentation leaves to the reader; they are defined at the end of this file.
Example 2 reads TRL's conversational format (``completion[0]["content"]``) with a signature that does not say
so: it is registered through ``trl_convention(..., conversational=True)``.
"""
from grpokit.rewards import orms, trl_convention


# --- Example 1: Reward longer completions ---
def reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]

orms["trl_ex1_token_length"] = reward_func


# --- Example 1.1: Reward longer completions (based on the number of characters) ---
def reward_func(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]

orms["trl_ex1_1_char_length"] = reward_func


# --- Example 2: Reward completions with a specific format ---
import re

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]

orms["trl_ex2_format"] = trl_convention(format_reward_func, conversational=True)


# --- Example 3: Reward completions based on a reference ---
import re

def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]

orms["trl_ex3_reference"] = reward_func


# --- Example 4: Multi-task reward functions ---
# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards

# Coding-specific reward function
def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "coding":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards

orms["trl_ex4_math"] = math_reward_func

orms["trl_ex4_coding"] = coding_reward_func


# --- Example 5: Asynchronous reward functions ---
import asyncio

async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]

orms["trl_ex5_async"] = async_reward_func


# --- Example 6: Logging extra columns and metrics ---
import re

def reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    extracted = [m.group(1) if m else None for m in extracted]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])

    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))

    return rewards

orms["trl_ex6_logging"] = reward_func


# --- helpers Example 4 calls (not in the documentation) ---
def check_math_solution(prompt, completion):
    return any(ch.isdigit() for ch in completion)


def test_code_solution(prompt, completion):
    return "def " in completion
