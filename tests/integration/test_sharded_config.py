"""The DeepSpeed config grpokit builds for every stage (distributed/zero.py) and the refusals around --fsdp /
--deepspeed, without a launch (the runs are in test_sharded_fsdp.py, test_sharded_zero3.py and
test_deepspeed_stages.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from grpokit.distributed.zero import PRESETS, deepspeed_config
from grpokit.errors import ConfigError


def _targs(**kw) -> SimpleNamespace:
    base = dict(deepspeed="zero3", gradient_accumulation_steps=1, max_grad_norm=0.5, per_device_train_batch_size=4)
    return SimpleNamespace(**{**base, **kw})


def test_zero3_preset_gets_every_auto_filled_from_the_options():
    ds = deepspeed_config(_targs(), hidden_size=64, world=2)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["train_batch_size"] == 8
    assert ds["gradient_accumulation_steps"] == 1
    assert ds["gradient_clipping"] == 0.5  # DeepSpeed's own default would clip at 1.0
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == 64 * 64
    assert zero["stage3_param_persistence_threshold"] == 640
    assert ds["zero_allow_untested_optimizer"] is True  # grpokit's torch optimizer
    assert deepspeed_config(_targs(max_grad_norm=0), 64, 2)["gradient_clipping"] == 0.0  # 0 turns clipping off
    offload = deepspeed_config(_targs(deepspeed="zero3_offload"), 64, 2)
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert offload["zero_force_ds_cpu_optimizer"] is False
    assert "auto" not in json.dumps(offload)
    assert PRESETS["zero3"]["reduce_bucket_size"] == "auto"  # a copy was filled, not the preset


def test_zero3_json_file_autos_and_clashes(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
                "bf16": {"enabled": "auto"},
                "train_micro_batch_size_per_gpu": "auto",
            }
        )
    )
    ds = deepspeed_config(_targs(deepspeed=str(cfg)), 32, 2)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 32 * 32 and ds["bf16"]["enabled"] is False
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 16}))
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu 16 in the file differs"):
        deepspeed_config(_targs(deepspeed=str(cfg)), 32, 2)
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}}))
    with pytest.raises(ConfigError, match='drop the "optimizer" section'):
        deepspeed_config(_targs(deepspeed=str(cfg)), 32, 2)
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}))
    with pytest.raises(ConfigError, match='cannot fill "auto" for zero_optimization.sub_group_size'):
        deepspeed_config(_targs(deepspeed=str(cfg)), 32, 2)
    cfg.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        deepspeed_config(_targs(deepspeed=str(cfg)), 32, 2)


def test_every_stage_counts_gradient_accumulation_and_runs_in_one_process():
    import torch
    from accelerate.utils import DistributedType

    from grpokit.distributed.processes import accelerate_plugins, check_backend

    ds = deepspeed_config(_targs(gradient_accumulation_steps=2), 64, 2)  # DeepSpeed counts the micro-steps
    assert ds["gradient_accumulation_steps"] == 2 and ds["train_batch_size"] == 4 * 2 * 2
    for preset in ("zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"):
        assert accelerate_plugins(SimpleNamespace(deepspeed=preset, fsdp=False)) == {}  # grpokit drives it
        one = SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1, device=torch.device("cpu"))
        check_backend(one, SimpleNamespace(deepspeed=preset, fsdp=False))  # one process on CPU: fine


def test_stage_0_to_2_configs(tmp_path):
    zero2 = deepspeed_config(_targs(deepspeed="zero2"), 64, 1)
    assert zero2["zero_optimization"] == {"stage": 2} and zero2["train_batch_size"] == 4
    assert zero2["gradient_clipping"] == 0.5 and zero2["zero_allow_untested_optimizer"] is True
    offload = deepspeed_config(_targs(deepspeed="zero2_offload"), 64, 1)["zero_optimization"]
    assert offload["offload_optimizer"]["device"] == "cpu" and "offload_param" not in offload
    assert deepspeed_config(_targs(deepspeed="zero0"), 64, 1)["zero_optimization"]["stage"] == 0
    cfg = tmp_path / "ds.json"
    cfg.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 1, "reduce_bucket_size": "auto", "allgather_bucket_size": "auto"},
                "gradient_accumulation_steps": "auto",
            }
        )
    )
    ds = deepspeed_config(_targs(deepspeed=str(cfg), gradient_accumulation_steps=3), 16, 2)
    assert ds["gradient_accumulation_steps"] == 3 and ds["zero_optimization"]["allgather_bucket_size"] == 256
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 8}))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps 8 in the file differs"):
        deepspeed_config(_targs(deepspeed=str(cfg)), 16, 2)
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2}, "managed_gradient_accumulation": False}))
    with pytest.raises(ConfigError, match="managed_gradient_accumulation false is not supported"):
        deepspeed_config(_targs(deepspeed=str(cfg)), 16, 2)
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 5}}))
    with pytest.raises(ConfigError, match="stage must be an integer 0-3, got 5"):
        deepspeed_config(_targs(deepspeed=str(cfg)), 16, 2)
    with pytest.raises(ConfigError, match="use one of zero0, zero1, zero2, zero2_offload, zero3, zero3_offload or"):
        deepspeed_config(_targs(deepspeed="zero9"), 16, 2)
    cfg.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        deepspeed_config(_targs(deepspeed=str(cfg)), 16, 2)


def test_zero3_refuses_an_engine_that_cannot_gather():
    import torch

    from grpokit.trainers.training_setup import setup_rollout

    policy = torch.nn.Linear(2, 2)
    policy.weight.ds_id = 0  # what ZeRO-3 marks its partitioned parameters with
    cfg = SimpleNamespace(training=SimpleNamespace(deepspeed="zero3"), rollout=SimpleNamespace(fast_decode=True))
    with pytest.raises(ConfigError, match="ZeRO-3 with a custom engine is not implemented"):
        setup_rollout(SimpleNamespace(engine_type="custom"), None, policy, None, cfg, None)
