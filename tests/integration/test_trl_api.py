"""TRL's documented GRPO examples, written as TRL users write them (``from trl import ...``), run with that import
renamed to ``grpokit.trl`` and nothing else changed: two steps each on the tiny model, in this process. And the
TRL API goes through the same assembly as ``grpokit train``: the option checks, the run-folder lock, the resume
check, the prompt bound."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
from datasets import Dataset

from grpokit.errors import ConfigError, GrpokitError

pytestmark = pytest.mark.slow

# what every example's GRPOConfig holds besides its own fields: a run of two steps, small enough for a CPU (in
# float32 without recomputed activations, as CPU scripts set it: TRL's bf16 and gradient_checkpointing defaults
# cost time here; tests/unit/test_trl_fields.py checks that they hold)
ARGS = (
    "output_dir=OUT, max_steps=2, num_generations=4, per_device_train_batch_size=4, max_completion_length=8, "
    "logging_steps=1, use_cpu=True, report_to='none', bf16=False, gradient_checkpointing=False"
)


def run(script: str, model, out, **names) -> dict:
    """``script`` with ``from trl`` → ``from grpokit.trl`` (the only change), run with MODEL and OUT set; its
    globals."""
    code = re.sub(r"\b(from|import) trl\b", r"\1 grpokit.trl", textwrap.dedent(script).replace("ARGS", ARGS))
    scope = {"MODEL": str(model), "OUT": str(out), **names}
    exec(compile(code, "trl_script.py", "exec"), scope)  # noqa: S102 - the test's own script
    return scope


def logged(out) -> list[dict]:
    return [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]


def completions(out) -> list[dict]:
    return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]


def math_rows(n: int = 8, system: bool = False) -> Dataset:
    """Conversational rows with a ``solution`` column (TRL's DeepMath shape), one with an unparseable solution."""
    head = [{"role": "system", "content": "Think, then answer in \\boxed{}."}] if system else []
    return Dataset.from_list(
        [
            {
                "prompt": [*head, {"role": "user", "content": f"What is {i} + {i}?"}],
                "solution": "$$" if i == 0 else str(2 * i),
            }
            for i in range(n)
        ]
    )


def test_quickstart_with_trl_rewards(tiny_model_dir, tmp_path):
    """TRL's quickstart: ``trl.rewards.accuracy_reward`` on conversational rows with a solution column."""
    scope = run(
        """
        from trl import GRPOConfig, GRPOTrainer
        from trl.rewards import accuracy_reward

        trainer = GRPOTrainer(model=MODEL, reward_funcs=accuracy_reward, args=GRPOConfig(ARGS),
                              train_dataset=dataset)
        result = trainer.train()
    """,
        tiny_model_dir,
        tmp_path,
        dataset=math_rows(),
    )
    assert scope["result"].global_step == 2
    rows = logged(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and "rewards/accuracy_reward/mean" in rows[0]
    args = json.loads((tmp_path / "args.json").read_text())
    # TRL's defaults hold under TRL's API: no KL term, dapo, full fine-tuning, 3 epochs (max_steps rules here)
    trl_defaults = (args["beta"], args["loss_type"], args["tuner_type"], args["num_train_epochs"])
    assert trl_defaults == (0.0, "dapo", "full", 3.0)


def test_rewards_with_columns_weights_none_async_and_logging(tiny_model_dir, tmp_path):
    """TRL's custom rewards: an extra dataset column, several rewards with reward_weights, None for samples a
    reward does not score, an async reward, completion_ids and trainer_state, and log_extra/log_metric with
    log_completions."""
    scope = run(
        """
        import asyncio
        from trl import GRPOConfig, GRPOTrainer

        seen = {}

        def match_ground_truth(prompts, completions, ground_truth, completion_ids, trainer_state, log_extra,
                               log_metric, **kwargs):
            seen.update(prompt=prompts[0], completion=completions[0], step=trainer_state.global_step)
            log_extra("length", [len(ids) for ids in completion_ids])
            log_metric("ground_truth_len", sum(len(g) for g in ground_truth) / len(ground_truth))
            return [float(c[0]["content"].strip() == g) for c, g in zip(completions, ground_truth)]

        def only_even(completions, kind, **kwargs):
            return [1.0 if k == "even" else None for k in kind]

        async def judged(completions, **kwargs):
            await asyncio.sleep(0)
            return [0.5 for _ in completions]

        trainer = GRPOTrainer(model=MODEL, reward_funcs=[match_ground_truth, only_even, judged],
                              args=GRPOConfig(ARGS, reward_weights=[1.0, 0.5, 2.0], log_completions=True),
                              train_dataset=dataset)
        trainer.train()
    """,
        tiny_model_dir,
        tmp_path,
        dataset=Dataset.from_list(
            [
                {
                    "prompt": [{"role": "user", "content": f"Repeat {i}"}],
                    "ground_truth": str(i),
                    "kind": "even" if i % 2 == 0 else "odd",
                }
                for i in range(8)
            ]
        ),
    )
    seen = scope["seen"]
    assert seen["prompt"][-1]["role"] == "user" and seen["completion"][0]["role"] == "assistant"
    assert seen["step"] in (0, 1)
    rows = logged(tmp_path)
    assert {
        "rewards/match_ground_truth/mean",
        "rewards/only_even/mean",
        "rewards/judged/mean",
        "ground_truth_len",
    } <= set(rows[0])
    assert rows[0]["rewards/judged/mean"] == 0.5 and rows[0]["ground_truth_len"] == 1.0
    logged_rows = completions(tmp_path)
    assert logged_rows and all("length" in r for r in logged_rows)


def test_peft_config_trains_the_adapter_and_save_model_writes_it(tiny_model_dir, tmp_path):
    """``peft_config=LoraConfig(...)`` wraps the model as given (its folder's tokenizer given as processing_class);
    ``save_model`` writes the adapter."""
    scope = run(
        """
        from peft import LoraConfig
        from transformers import AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        def reward_len(completions, **kwargs):
            return [-abs(5 - len(c[0]["content"])) for c in completions]

        trainer = GRPOTrainer(model=MODEL, reward_funcs=reward_len, args=GRPOConfig(ARGS), train_dataset=dataset,
                              processing_class=AutoTokenizer.from_pretrained(MODEL),
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        trainer.train()
        trainer.save_model(OUT + "/adapter")
    """,
        tiny_model_dir,
        tmp_path,
        dataset=math_rows(),
    )
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and set(config["target_modules"]) == {"q_proj", "v_proj"}
    assert json.loads((tmp_path / "args.json").read_text())["tuner_type"] == "lora"
    assert scope["trainer"].model is not None


def test_reward_model_path_and_model_object(tiny_model_dir, tiny_rm_dir, tmp_path):
    """A reward model by folder in ``reward_funcs`` beside a function, and the policy given as a loaded model
    (with its tokenizer as processing_class): the model's column is named after its folder."""
    run(
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        def reward_len(completions, **kwargs):
            return [float(len(c)) for c in completions]

        model = AutoModelForCausalLM.from_pretrained(MODEL)
        trainer = GRPOTrainer(model=model, processing_class=AutoTokenizer.from_pretrained(MODEL),
                              reward_funcs=[RM, reward_len], args=GRPOConfig(ARGS, reward_weights=[1.0, 0.1]),
                              train_dataset=dataset)
        trainer.train()
    """,
        tiny_model_dir,
        tmp_path,
        RM=str(tiny_rm_dir),
        dataset=Dataset.from_list([{"prompt": f"Say {i}"} for i in range(8)]),
    )
    rows = logged(tmp_path)
    assert f"rewards/{tiny_rm_dir.name}/mean" in rows[0] and "rewards/reward_len/mean" in rows[0]


def test_callbacks_system_prompt_evaluate_and_resume(tiny_model_dir, tmp_path):
    """A transformers callback sees each step; conversational rows with a system prompt; evaluate() after
    training; then ``train(resume_from_checkpoint=True)`` continues from the last checkpoint."""
    scope = run(
        """
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        class Steps(TrainerCallback):
            def __init__(self):
                self.steps = []

            def on_step_end(self, args, state, control, **kwargs):
                self.steps.append(state.global_step)

        def brief(completions, **kwargs):
            return [-float(len(c[0]["content"])) for c in completions]

        steps = Steps()
        args = GRPOConfig(ARGS, save_steps=1, eval_strategy="steps", eval_steps=2)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=brief, args=args,
                              train_dataset=dataset, eval_dataset=dataset.select(range(2)), callbacks=[steps])
        trainer.train()
        metrics = trainer.evaluate()
        args = GRPOConfig(ARGS, save_steps=1)
        args.max_steps = 3
        again = GRPOTrainer(model=MODEL, reward_funcs=brief, args=args, train_dataset=dataset)
        resumed = again.train(resume_from_checkpoint=True)
    """,
        tiny_model_dir,
        tmp_path,
        dataset=math_rows(system=True),
    )
    assert scope["steps"].steps == [1, 2]
    assert scope["metrics"]["eval_brief/greedy"] <= 0  # evaluate(): the reward on greedy completions
    evaluated = [r for r in logged(tmp_path) if any(k.startswith("eval/") for k in r)]
    assert evaluated and evaluated[0]["step"] == 2  # eval_strategy="steps", eval_steps=2 during training
    assert scope["resumed"].global_step == 3
    assert [r["step"] for r in logged(tmp_path)][-1] == 3


def test_a_second_run_on_a_locked_folder_stops_with_one_line(tiny_model_dir, tmp_path):
    """A callback of the first run starts a second TRL-API run on the same output_dir: refused by the lock,
    before any model loads; the first run finishes."""
    scope = run(
        """
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        def brief(completions, **kwargs):
            return [-float(len(c[0]["content"])) for c in completions]

        errors = []

        class SecondRun(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                try:
                    GRPOTrainer(model=MODEL, reward_funcs=brief, args=GRPOConfig(ARGS), train_dataset=dataset).train()
                except Exception as e:
                    errors.append(e)

        first = GRPOTrainer(model=MODEL, reward_funcs=brief, args=GRPOConfig(ARGS), train_dataset=dataset,
                            callbacks=[SecondRun()])
        result = first.train()
    """,
        tiny_model_dir,
        tmp_path,
        dataset=math_rows(),
    )
    assert scope["result"].global_step == 2 and len(scope["errors"]) == 2
    error = scope["errors"][0]
    assert isinstance(error, GrpokitError) and "\n" not in str(error)
    assert str(error).startswith(f"--output_dir {tmp_path} is in use by pid")


def test_trl_api_gets_the_prompt_bound_and_the_resume_check(tiny_model_dir, tmp_path):
    """The model's context bounds max_completion_length before training (the tiny model's is 1024); a resume
    with a changed option is refused before any model loads."""
    from grpokit.trl import GRPOConfig, GRPOTrainer

    def trainer(**fields):
        args = GRPOConfig(
            output_dir=str(tmp_path),
            use_cpu=True,
            max_steps=1,
            num_generations=2,
            per_device_train_batch_size=2,
            report_to="none",
            **fields,
        )
        return GRPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            train_dataset=math_rows(),
            args=args,
        )

    with pytest.raises(ConfigError, match=r"^--max_completion_length 1024: the model .* context of 1024 tokens"):
        trainer(max_completion_length=1024).train()
    trainer(max_completion_length=8).train()
    with pytest.raises(GrpokitError, match="learning_rate") as err:
        trainer(max_completion_length=8, learning_rate=1e-5).train(resume_from_checkpoint=True)
    assert "\n" not in str(err.value)


# ChatML that renders tools= (as Qwen's templates do: a system block listing them), for the tool examples
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n<tools>' }}{% for t in tools %}{{ t | tojson }}{% endfor %}"
    '{{ \'</tools>\nCall one with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n\' }}'
    "{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}{{ '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    from grpokit.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tool_model") / "model", chat_template=TOOL_TEMPLATE)


def test_tools_and_environment_factory(tool_model_dir, tmp_path):
    """TRL's tool and environment examples: plain functions (one async) as tools, an environment whose methods
    are tools, whose reset starts each rollout and whose state the reward reads."""
    scope = run(
        """
        from trl import GRPOConfig, GRPOTrainer

        async def multiply(a: int, b: int) -> int:
            \"\"\"Multiply two integers.

            Args:
                a: The first integer.
                b: The second integer.
            \"\"\"
            return a * b

        class Wordle:
            def reset(self, **kwargs):
                self.guesses = 0
                return " Guess a five-letter word."

            def guess(self, word: str) -> str:
                \"\"\"Guess the word.

                Args:
                    word: A five-letter word.
                \"\"\"
                self.guesses += 1
                return "no"

        def few_guesses(environments, **kwargs):
            return [-float(env.guesses) for env in environments]

        trainer = GRPOTrainer(model=MODEL, reward_funcs=few_guesses, train_dataset=dataset, tools=[multiply],
                              environment_factory=Wordle, args=GRPOConfig(ARGS, max_tool_calling_iterations=2,
                                                                          log_completions=True))
        trainer.train()
    """,
        tool_model_dir,
        tmp_path,
        dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": f"Play {i}."}]} for i in range(8)]),
    )
    rows = completions(tmp_path)
    assert rows and all("Guess a five-letter word." in json.dumps(r) for r in rows)  # reset's text in the prompt
    assert "rewards/few_guesses/mean" in logged(tmp_path)[0]
    assert scope["trainer"].state.global_step == 2


def test_rollout_func_generates_and_its_fields_reach_the_rewards(tiny_model_dir, tmp_path):
    """TRL's rollout_func contract: each prompt once, num_generations completions back with their logprobs, and
    an extra field the reward reads by name."""
    scope = run(
        """
        from trl import GRPOConfig, GRPOTrainer

        calls = []

        def rollout_func(prompts, trainer):
            tok = trainer.processing_class
            out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "judge": []}
            calls.append(len(prompts))
            for prompt in prompts:
                text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
                prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
                for k in range(trainer.args.num_generations):
                    ids = tok(str(k), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                    out["prompt_ids"].append(prompt_ids)
                    out["completion_ids"].append(ids)
                    out["logprobs"].append([-1.0] * len(ids))
                    out["judge"].append(float(k))
            return out

        def judged(completions, judge, **kwargs):
            return judge

        trainer = GRPOTrainer(model=MODEL, reward_funcs=judged, args=GRPOConfig(ARGS), train_dataset=dataset,
                              rollout_func=rollout_func)
        trainer.train()
    """,
        tiny_model_dir,
        tmp_path,
        dataset=math_rows(),
    )
    assert scope["calls"] == [1, 1]  # 4 completions a step: one prompt, num_generations=4
    assert [r["rewards/judged/mean"] for r in logged(tmp_path)] == [1.5, 1.5]  # judge 0, 1, 2, 3
