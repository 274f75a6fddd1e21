"""The shapes ms-swift's trainer plugins expect, on their own: the batch as the seed's mini-batch dict, the
refusal of uncalled methods, the loss conventions, the OptimizerCallback and HF callback adapters, OpenEnv."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpokit.errors import ConfigError, PluginError
from grpokit.trainers.batch import SEED_KEYS, RolloutBatch


def _batch(n: int = 4, p: int = 3, c: int = 2) -> RolloutBatch:
    att = torch.ones(n, p + c, dtype=torch.long)
    return RolloutBatch(
        input_ids=torch.arange(n * (p + c)).view(n, p + c),
        attention_mask=att,
        position_ids=(att.cumsum(-1) - 1),
        completion_mask=torch.ones(n, c),
        truncated=torch.zeros(n, dtype=torch.bool),
        advantages=torch.arange(n).float(),
    )


def test_the_batch_reads_and_writes_as_the_seeds_dict():
    b = _batch()
    assert b["logits_to_keep"] == 2 and b["input_ids"] is b.input_ids and b["truncated_mask"] is b.truncated
    assert b["advantages"] is b.advantages and b.truncated_mask is b.truncated
    assert "old_per_token_logps" not in b and b.get("old_per_token_logps") is None and b["old_per_token_logps"] is None
    b["old_per_token_logps"] = torch.zeros(4, 2)
    assert b.old_logps is not None and "old_per_token_logps" in b
    b["num_items_in_batch"] = 7.0
    assert b.num_items == 7.0
    b["my_key"] = torch.arange(4)
    assert b.extra["my_key"] is b["my_key"] and "my_key" in b and b.get("nope", 3) == 3
    assert set(SEED_KEYS) - {"ref_per_token_logps", "rollout_per_token_logps"} <= set(b.keys())
    with pytest.raises(KeyError, match="logits_to_keep"):
        b["logits_to_keep"] = 1
    with pytest.raises(KeyError, match="nope"):
        b["nope"]


def test_extra_keys_follow_select_split_and_to():
    b = _batch()
    b["w"] = torch.arange(4).float()
    b["names"] = ["a", "b", "c", "d"]
    parts = b.split(2)
    assert [p["w"].tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0]]
    assert [p["names"] for p in parts] == [["a", "b"], ["c", "d"]]
    moved = b.to("cpu")
    assert moved["w"] is not None and moved.extra is not b.extra and moved.step_metrics is b.step_metrics


def test_join_puts_mini_batches_back_and_checks_them():
    b = _batch()
    chunks = b.chunks(2)
    for c in chunks:
        c["w"] = torch.full((len(c),), 0.5)
    joined = RolloutBatch.join(chunks, 4, "_prepare_batch_inputs")
    assert torch.equal(joined.input_ids, b.input_ids) and joined["w"].tolist() == [0.5] * 4
    with pytest.raises(PluginError, match="rows in all; the window has 5"):
        RolloutBatch.join(chunks, 5, "_prepare_batch_inputs")
    with pytest.raises(PluginError, match="returned dict"):
        RolloutBatch.join({}, 4, "_prepare_batch_inputs")
    chunks[1].extra.pop("w")
    with pytest.raises(PluginError, match="same added keys"):
        RolloutBatch.join(chunks, 4, "_prepare_batch_inputs")
    with pytest.raises(PluginError, match="different widths"):
        RolloutBatch.join([b.select(slice(0, 2)), _batch(2, 3, 1)], 4, "_prepare_batch_inputs")


def test_a_subclass_with_an_uncalled_method_is_refused_in_one_line():
    from grpokit.trainers.grpo_trainer import GRPOTrainer
    from grpokit.trainers.hooks import check_subclass

    class Fine(GRPOTrainer):
        def _compute_advantages(self, inputs, rewards_per_func, batch_encoded_inputs):
            return torch.zeros(len(rewards_per_func))

    check_subclass(Fine, GRPOTrainer)

    class Mixin:
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return 0

    class Bad(Mixin, Fine):
        pass

    with pytest.raises(ConfigError) as err:
        check_subclass(Bad, GRPOTrainer)
    assert "\n" not in str(err.value) and "compute_loss()" in str(err.value)
    assert "_compute_loss_and_metrics(model, inputs)" in str(err.value)


def test_loss_conventions_are_told_apart_by_the_signature():
    from grpokit.trainers.hooks import call_loss, loss_convention, positional_count

    class T:
        def seed(self, model, inputs):
            return torch.tensor(1.0, requires_grad=True), {"a": 1}

        def swift46(self, model, model_inputs, grpo_batch):
            return torch.tensor(2.0, requires_grad=True), None

        def step_old(self, model, inputs): ...

        def step_new(self, model, inputs, num_items_in_batch=None): ...

        def wrong(self, model, inputs):
            return 3.0

    t = T()
    assert loss_convention(t.seed) == "batch" and loss_convention(t.swift46) == "swift46"
    assert positional_count(t.step_old) == 2 and positional_count(t.step_new) == 3
    assert call_loss(t.swift46, "swift46", None, None)[1] == {}
    with pytest.raises(PluginError, match="return \\(loss tensor, metrics dict\\)"):
        call_loss(t.wrong, "batch", None, None)


def test_optimizer_callback_shapes():
    from grpokit.trainers.optimizers import OptimizerCallback, build_optimizer, build_sgd

    args = SimpleNamespace(
        learning_rate=0.1,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        lr_scheduler_type="constant",
        lr_scheduler_kwargs=None,
        warmup_steps=0,
        warmup_ratio=0.0,
    )
    model = torch.nn.Linear(2, 2)
    trainer = SimpleNamespace(model=model)
    opt, sched = build_optimizer(OptimizerCallback, list(model.parameters()), args, trainer, 10)
    assert isinstance(opt, torch.optim.AdamW) and sched.get_last_lr() == [0.1]
    opt, _ = build_optimizer(build_sgd, list(model.parameters()), args, None, 10)
    assert isinstance(opt, torch.optim.SGD)

    class NotAnOptimizer(OptimizerCallback):
        def create_optimizer(self, model=None):
            return "adam"

    with pytest.raises(PluginError, match="returned str; return a torch.optim.Optimizer"):
        build_optimizer(NotAnOptimizer, [], args, trainer, 10)

    class Both(OptimizerCallback):
        def create_optimizer_and_scheduler(self, num_training_steps): ...

    with pytest.raises(PluginError, match="create_optimizer_and_scheduler, which grpokit does not call"):
        build_optimizer(Both, [], args, trainer, 10)


def test_hf_callbacks_are_built_and_driven_hfs_way():
    from transformers import TrainerCallback, TrainerControl

    from grpokit.trainers.hf_callbacks import HFCallbackDriver, build, hf_args, is_hf_callback

    seen = []

    class Plain(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append((state.global_step, state.epoch, args.learning_rate, sorted(kwargs)))
            control.should_save = True

    class Swift(TrainerCallback):
        def __init__(self, args, trainer):
            self.args, self.trainer = args, trainer

        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(logs)
            return TrainerControl(should_training_stop=True)

    args = hf_args(
        {"learning_rate": 0.5, "logging_steps": 1, "eval_steps": None, "save_steps": 10, "num_train_epochs": 1.0},
        process_index=0,
        world_size=1,
        is_main=True,
    )
    plain, swift = build(Plain, args, "T"), build(Swift, args, "T")
    assert is_hf_callback(Plain) and is_hf_callback(plain) and not is_hf_callback(object())
    assert swift.trainer == "T"
    driver = HFCallbackDriver([plain, swift], args, max_steps=3, train_batch_size=4, is_main=True)
    loop = SimpleNamespace(global_step=1, max_steps=3, epoch=0.25, log_history=[{"step": 1}])
    driver.event("on_step_end", loop, model="m")
    assert seen == [(1, 0.25, 0.5, ["model"])] and driver.control.should_save
    driver.new_step()
    assert not driver.control.should_save
    driver.event("on_log", loop, logs={"loss": 1.0})
    assert seen[-1] == {"loss": 1.0} and driver.control.should_training_stop
    assert driver.state.log_history is loop.log_history


def test_open_env_scheduler_refuses_a_server_row_naming_the_in_process_fix():
    from grpokit.protocol import RolloutInferRequest
    from grpokit.rollout.multi_turn import multi_turns
    from grpokit.swift.rollout.multi_turn import OpenEnvScheduler

    assert multi_turns["OpenEnvScheduler"] is OpenEnvScheduler is multi_turns["openenv_scheduler"]
    row = RolloutInferRequest(
        messages=[{"role": "user", "content": "Play"}],
        data_dict={"env_config": {"name": "openenv", "base_url": "http://127.0.0.1:8000"}},
    )
    with pytest.raises(ConfigError, match="in process: give env_config.env"):
        OpenEnvScheduler()._make_env(row)
    with pytest.raises(ConfigError, match="--openenv_env 'no_such_module:Env': cannot import"):
        OpenEnvScheduler(openenv_env="no_such_module:Env")


def test_a_training_step_override_under_sharded_gradients_is_warned_once(caplog):
    from grpokit.trainers.grpo_trainer import GRPOTrainer
    from grpokit.trainers.hooks import warn_sharded_grad_edit

    class Edits(GRPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            return super().training_step(model, inputs, num_items_in_batch)

    caplog.set_level("WARNING", logger="grpokit.trainers.hooks")
    for deepspeed, fsdp in (("zero3", ""), ("zero2", ""), (None, "full_shard")):
        warn_sharded_grad_edit(Edits, GRPOTrainer, SimpleNamespace(deepspeed=deepspeed, fsdp=fsdp))
    warn_sharded_grad_edit(Edits, GRPOTrainer, SimpleNamespace(deepspeed="zero1", fsdp=""))  # whole gradients
    warn_sharded_grad_edit(GRPOTrainer, GRPOTrainer, SimpleNamespace(deepspeed="zero3", fsdp=""))  # no override
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all("p.grad is not the full gradient" in line for line in lines)
    assert "ZeRO-3" in lines[0] and "ZeRO-2" in lines[1] and "--fsdp" in lines[2]
