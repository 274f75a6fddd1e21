"""The seed's customisation recipes ("动手改": subclass GRPOTrainer, override a hook, register it in one
--external_plugins file), each as its own plugin file written with ms-swift's (and TRL's) imports and ported by
the documented rename (`from swift` → `from grpokit.swift`, `from trl` → `from grpokit.trl`) and nothing else,
trained on the tiny model; each shows its effect from outside the run."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import textwrap

import pytest
import torch
from support import flags

pytestmark = pytest.mark.slow

HEADER = "import torch\nfrom swift.trainers import TrainerFactory\nfrom swift.rlhf_trainers import GRPOTrainer\n"
REGISTER = "\nTrainerFactory.TRAINER_MAPPING['grpo'] = '{module}.MyGRPOTrainer'\n"

# the seed's forward recipe, as written there (the hidden states are kept for the loss)
FORWARD = """
from trl.trainer.utils import selective_log_softmax

class MyGRPOTrainer(GRPOTrainer):
    def _get_per_token_logps_and_entropies(self, model, inputs, compute_entropy=False):
        if not torch.is_grad_enabled():
            return super()._get_per_token_logps_and_entropies(model, inputs, compute_entropy)
        model_inputs = self._prepare_model_inputs(inputs)
        outputs = model(**model_inputs, output_hidden_states=True)
        logits = outputs.logits[:, -(inputs['logits_to_keep'] + 1):-1, :] / self.temperature
        completion_ids = inputs['input_ids'][:, -inputs['logits_to_keep']:]
        per_token_logps = selective_log_softmax(logits, completion_ids)
        self._my_hidden = outputs.hidden_states[-1]
        return per_token_logps, None
"""

# the seed's loss, from the mini-batch dict's keys (token-level PPO-clip, k3 KL, group normalisation)
LOSS = """
class MyGRPOTrainer(GRPOTrainer):
    def _compute_loss_and_metrics(self, model, inputs):
        completion_mask = inputs['completion_mask']
        per_token_logps, entropies = self._get_per_token_logps_and_entropies(model, inputs)
        per_token_kl = None
        if self.beta != 0.0:
            ref_per_token_logps = inputs['ref_per_token_logps']
            safe_ratio = torch.clamp(ref_per_token_logps - per_token_logps, min=-20, max=20)
            per_token_kl = torch.clamp(torch.exp(safe_ratio) - safe_ratio - 1, min=-10, max=10)
        advantages = inputs['advantages']
        old_per_token_logps = inputs['old_per_token_logps']
        if old_per_token_logps is None:
            old_per_token_logps = per_token_logps.detach()
        log_importance_weights = per_token_logps - old_per_token_logps
        coef_1 = torch.exp(log_importance_weights)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token_loss1 = coef_1 * advantages.unsqueeze(1)
        per_token_loss2 = coef_2 * advantages.unsqueeze(1)
        per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
        if per_token_kl is not None:
            per_token_loss = per_token_loss + self.beta * per_token_kl
        loss = ((per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)).mean()
        return loss, {'my_loss': loss.detach()}
"""

ADVANTAGE = """
class MyGRPOTrainer(GRPOTrainer):
    def _compute_advantages(self, inputs, rewards_per_func, batch_encoded_inputs):
        return torch.ones(rewards_per_func.shape[0])
"""

GRAD_ZERO = """
class MyGRPOTrainer(GRPOTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad = torch.zeros_like(p.grad)
        return loss
"""

BATCH_KEY = """
class MyGRPOTrainer(GRPOTrainer):
    def _prepare_batch_inputs(self, inputs):
        batch_encoded_inputs = super()._prepare_batch_inputs(inputs)
        for batch in batch_encoded_inputs:
            batch['my_weight'] = torch.full((len(batch['input_ids']),), 0.5)
        return batch_encoded_inputs

    def _compute_loss_and_metrics(self, model, inputs):
        loss, metrics = super()._compute_loss_and_metrics(model, inputs)
        metrics['my_weight'] = inputs['my_weight'].mean()
        return loss * inputs['my_weight'].mean(), metrics
"""

OPTIMIZER = """
import torch
from swift.optimizers import OptimizerCallback, optimizers_map

class CountingSGD(torch.optim.SGD):
    steps = 0

    def step(self, closure=None):
        CountingSGD.steps += 1
        return super().step(closure)

class MyOptimizerCallback(OptimizerCallback):
    def create_optimizer(self, model=None):
        model = model if model is not None else self.trainer.model
        params = [p for p in model.parameters() if p.requires_grad]
        return CountingSGD(params, lr=self.args.learning_rate)

optimizers_map['counting_sgd'] = MyOptimizerCallback
"""

CALLBACK = """
from swift.callbacks import TrainerCallback, callbacks_map

class StopAfterTwo(TrainerCallback):
    seen = []

    def on_step_end(self, args, state, control, **kwargs):
        StopAfterTwo.seen.append((state.global_step, state.max_steps, args.learning_rate))
        if state.global_step >= 2:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        StopAfterTwo.seen.append(("log", logs["step"], len(state.log_history)))

callbacks_map['stop_after_two'] = StopAfterTwo
"""

# ms-swift 4.6's loss signature, adding a term on top of grpokit's loss
LOSS_46 = """
class MyGRPOTrainer(GRPOTrainer):
    def _compute_loss_and_metrics(self, model, model_inputs, grpo_batch):
        loss, metrics_data = super()._compute_loss_and_metrics(model, model_inputs, grpo_batch)
        metrics_data['mask_tokens'] = grpo_batch.completion_mask.sum()
        metrics_data['same_batch'] = float(model_inputs['input_ids'] is grpo_batch['input_ids'])
        return loss + 0.0 * grpo_batch.truncated_mask.float().sum(), metrics_data
"""

CONTROL = """
from swift.callbacks import TrainerCallback, callbacks_map

class AskAtStepTwo(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            control.should_log = True
            control.should_save = True

callbacks_map['ask_at_step_two'] = AskAtStepTwo
"""

UNCALLED = """
class MyGRPOTrainer(GRPOTrainer):
    def _get_logps_via_local_forward(self, model, inputs):
        raise AssertionError("never called")
"""


def port(text: str) -> str:
    """The documented rename, and nothing else."""
    return re.sub(r"\b(from|import) (swift|trl)(?=[. ])", r"\1 grpokit.\2", text)


def write_plugin(tmp_path, name: str, body: str, trainer: bool = True) -> str:
    text = (HEADER + body + REGISTER.format(module=name)) if trainer else body
    path = tmp_path / f"{name}.py"
    path.write_text(port(textwrap.dedent(text)))
    return str(path)


@pytest.fixture
def restore():
    from grpokit.trainers.factory import TrainerFactory

    saved = dict(TrainerFactory.TRAINER_MAPPING)
    yield
    TrainerFactory.TRAINER_MAPPING.clear()
    TrainerFactory.TRAINER_MAPPING.update(saved)
    for name in [m for m in sys.modules if m.startswith("recipe_")]:
        sys.modules.pop(name)
    from grpokit.rewards import orms

    orms.pop("recipe_shorter", None)


# a random tiny model never solves the rows: accuracy is 0 everywhere and no advantage moves a weight; this reward
# varies within every group (a second plugin file, loaded after the recipe's)
SIGNAL = """
from grpokit.rewards import orms

orms["recipe_shorter"] = lambda completions, **kwargs: [1.0 / (1 + len(c)) for c in completions]
"""


def train(tiny_model_dir, math_jsonl, out, plugin: str, *extra: str):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    signal = out.parent / "recipe_signal.py"
    signal.write_text(SIGNAL)
    return run_train(
        parse_train_args(
            flags(
                {"--model": tiny_model_dir, "--dataset": math_jsonl, "--output_dir": out},
                "--tuner_type full",
                {"--external_plugins": plugin},
                str(signal),
                "--reward_funcs recipe_shorter --num_generations 4 --per_device_train_batch_size 4",
                "--max_completion_length 8 --beta 0 --torch_dtype float32 --logging_steps 1 --seed 0",
                "--disable_tqdm true --plots false --save_final_model false --learning_rate 1e-3",
                *extra,
            )
        )
    )


def log_rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_forward_override_gives_the_trained_logps(tiny_model_dir, math_jsonl, tmp_path, restore):
    trainer = train(
        tiny_model_dir,
        math_jsonl,
        tmp_path / "out",
        write_plugin(tmp_path, "recipe_forward", FORWARD),
        "--max_steps",
        "2",
    )
    assert type(trainer).__name__ == "MyGRPOTrainer" and trainer.state.global_step == 2
    hidden = trainer._my_hidden  # set by the override's forward, the one with gradients
    assert hidden.shape[0] == 4 and hidden.shape[-1] == trainer.policy.config.hidden_size
    assert hidden.requires_grad
    assert all(r["loss"] == r["loss"] for r in log_rows(tmp_path / "out"))


def test_loss_from_the_dict_keys_trains(tiny_model_dir, math_jsonl, tmp_path, restore):
    from transformers import AutoModelForCausalLM

    before = weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    plugin = write_plugin(tmp_path, "recipe_loss", LOSS)
    trainer = train(tiny_model_dir, math_jsonl, tmp_path / "out", plugin, "--max_steps", "2")
    rows = log_rows(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2] and all("my_loss" in r for r in rows)
    after = weights(trainer.policy)
    assert max(float((after[n] - before[n]).abs().max()) for n in before) > 0  # the loss moved the weights


def test_advantage_override_of_ones_gives_loss_minus_one(tiny_model_dir, math_jsonl, tmp_path, restore):
    trainer = train(
        tiny_model_dir,
        math_jsonl,
        tmp_path / "out",
        write_plugin(tmp_path, "recipe_adv", ADVANTAGE),
        "--max_steps",
        "2",
    )
    rows = log_rows(tmp_path / "out")
    assert trainer.state.global_step == 2
    for r in rows:  # on-policy: ratio 1, every advantage 1 → −1 per token, averaged per sequence
        assert r["loss"] == pytest.approx(-1.0, abs=1e-5)
        assert r["advantages/mean"] == 1.0 and r["advantages/std"] == 0.0


def test_training_step_zeroing_gradients_leaves_the_weights(tiny_model_dir, math_jsonl, tmp_path, restore):
    from transformers import AutoModelForCausalLM

    before = weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    trainer = train(
        tiny_model_dir,
        math_jsonl,
        tmp_path / "out",
        write_plugin(tmp_path, "recipe_grad", GRAD_ZERO),
        *flags("--max_steps 2 --gradient_accumulation_steps 2 --weight_decay 0 --max_grad_norm 0"),
    )
    assert trainer.state.global_step == 2
    after = weights(trainer.policy)
    assert max(float((after[n] - before[n]).abs().max()) for n in before) == 0.0


def test_training_step_without_the_edit_moves_the_weights(tiny_model_dir, math_jsonl, tmp_path, restore):
    """The control for the test above: the same run with the plain training_step changes the weights."""
    from transformers import AutoModelForCausalLM

    before = weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    plugin = write_plugin(tmp_path, "recipe_plain", ADVANTAGE)  # all-one advantages: a gradient every step
    trainer = train(
        tiny_model_dir,
        math_jsonl,
        tmp_path / "out",
        plugin,
        *flags("--max_steps 2 --gradient_accumulation_steps 2 --weight_decay 0 --max_grad_norm 0"),
    )
    after = weights(trainer.policy)
    assert max(float((after[n] - before[n]).abs().max()) for n in before) > 0


def test_optimizer_callback_takes_every_step(tiny_model_dir, math_jsonl, tmp_path, restore):
    plugin = write_plugin(tmp_path, "recipe_opt", OPTIMIZER, trainer=False)
    trainer = train(
        tiny_model_dir,
        math_jsonl,
        tmp_path / "out",
        plugin,
        *flags("--max_steps 3 --optimizer counting_sgd --gradient_accumulation_steps 2"),
    )
    counting = sys.modules["recipe_opt"].CountingSGD
    assert counting.steps == 3 and trainer.state.global_step == 3
    assert isinstance(trainer.optimizer.optimizer, counting)
    assert [r["learning_rate"] for r in log_rows(tmp_path / "out")][0] > 0


def test_hf_callback_sees_each_step_and_stops_the_run(tiny_model_dir, math_jsonl, tmp_path, restore):
    plugin = write_plugin(tmp_path, "recipe_cb", CALLBACK, trainer=False)
    trainer = train(
        tiny_model_dir, math_jsonl, tmp_path / "out", plugin, "--max_steps", "5", "--callbacks", "stop_after_two"
    )
    seen = sys.modules["recipe_cb"].StopAfterTwo.seen
    assert seen == [(1, 5, 1e-3), ("log", 1, 1), (2, 5, 1e-3), ("log", 2, 2)]
    assert trainer.state.global_step == 2  # stopped by control.should_training_stop, not at max_steps
    assert [r["step"] for r in log_rows(tmp_path / "out")] == [1, 2]
    assert (tmp_path / "out" / "checkpoint-2").is_dir()  # the run ended as a finished one


def test_hf_control_should_log_and_should_save_are_honoured(tiny_model_dir, math_jsonl, tmp_path, restore):
    plugin = write_plugin(tmp_path, "recipe_ctl", CONTROL, trainer=False)
    train(
        tiny_model_dir,
        math_jsonl,
        tmp_path / "out",
        plugin,
        *flags(
            "--max_steps 4 --callbacks ask_at_step_two --logging_steps 100 --logging_first_step false",
            "--save_steps 100",
        ),
    )
    assert [r["step"] for r in log_rows(tmp_path / "out")] == [2, 4]  # asked for at 2; 4 is the last step
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def test_prepare_batch_inputs_key_reaches_the_loss(tiny_model_dir, math_jsonl, tmp_path, restore):
    train(
        tiny_model_dir,
        math_jsonl,
        tmp_path / "out",
        write_plugin(tmp_path, "recipe_key", BATCH_KEY),
        "--max_steps",
        "2",
        "--steps_per_generation",
        "2",
    )
    assert [r["my_weight"] for r in log_rows(tmp_path / "out")] == [0.5, 0.5]


def test_ms_swift_46_loss_signature_is_called_its_way(tiny_model_dir, math_jsonl, tmp_path, restore):
    train(
        tiny_model_dir,
        math_jsonl,
        tmp_path / "out",
        write_plugin(tmp_path, "recipe_loss46", LOSS_46),
        "--max_steps",
        "2",
    )
    rows = log_rows(tmp_path / "out")
    assert all(r["mask_tokens"] > 0 and r["same_batch"] == 1.0 for r in rows)


def test_uncalled_ms_swift_method_is_refused_in_one_line(tiny_model_dir, math_jsonl, tmp_path, restore):
    from grpokit.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        train(
            tiny_model_dir,
            math_jsonl,
            tmp_path / "out",
            write_plugin(tmp_path, "recipe_uncalled", UNCALLED),
            "--max_steps",
            "1",
        )
    message = str(err.value)
    assert "\n" not in message and "_get_logps_via_local_forward" in message
    assert "_get_per_token_logps_and_entropies" in message


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")
def test_recipes_under_zero3_in_two_processes(tiny_model_dir, math_jsonl, tmp_path):
    """The forward, loss and advantage recipes in one trainer class, 2 processes, --deepspeed zero3: every
    advantage 1 on-policy gives loss −1 through the seed's loss over the override's logps."""
    from test_distributed import _torchrun

    body = (
        FORWARD.replace("class MyGRPOTrainer(GRPOTrainer):", "class Forward(GRPOTrainer):")
        + LOSS.replace("class MyGRPOTrainer(GRPOTrainer):", "class Loss(Forward):")
        + ADVANTAGE.replace("class MyGRPOTrainer(GRPOTrainer):", "class MyGRPOTrainer(Loss):")
        + "\nimport os, json\n"
        + "_orig = MyGRPOTrainer._compute_loss_and_metrics\n"
        + "def _record(self, model, inputs):\n"
        + "    loss, m = _orig(self, model, inputs)\n"
        + "    m['hidden_rows'] = float(self._my_hidden.shape[0])\n"
        + "    return loss, m\n"
        + "MyGRPOTrainer._compute_loss_and_metrics = _record\n"
    )
    plugin = write_plugin(tmp_path, "recipe_zero3", body)
    out = tmp_path / "zero3"
    _torchrun(
        flags(
            {"--model": tiny_model_dir, "--dataset": math_jsonl, "--output_dir": out, "--external_plugins": plugin},
            "--tuner_type full --reward_funcs accuracy --num_generations 4 --per_device_train_batch_size 4",
            "--max_completion_length 8 --beta 0 --torch_dtype float32 --use_cpu true --logging_steps 1 --seed 0",
            "--disable_tqdm true --plots false --save_final_model false --max_steps 2 --deepspeed zero3",
        ),
        tmp_path / "dump",
    )
    rows = log_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["loss"] == pytest.approx(-1.0, abs=1e-5) and r["my_loss"] == pytest.approx(-1.0, abs=1e-5)
        assert r["hidden_rows"] == 4.0  # the override's forward gave the trained logps on both ranks
