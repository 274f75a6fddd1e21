"""The DeepSpeed ZeRO-3 config grpokit builds (trainers/zero.py) and the refusals around --fsdp / ZeRO-3, without a
launch (the runs are in test_sharded_fsdp.py and test_sharded_zero3.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from grpokit.errors import ConfigError
from grpokit.trainers.zero import PRESETS, zero3_config


def _targs(**kw) -> SimpleNamespace:
    base = dict(deepspeed="zero3", gradient_accumulation_steps=1, max_grad_norm=0.5, per_device_train_batch_size=4)
    return SimpleNamespace(**{**base, **kw})


def test_zero3_preset_gets_every_auto_filled_from_the_options():
    ds = zero3_config(_targs(), hidden_size=64, world=2)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["train_batch_size"] == 8
    assert ds["gradient_accumulation_steps"] == 1
    assert ds["gradient_clipping"] == 0.5  # DeepSpeed's own default would clip at 1.0
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == 64 * 64
    assert zero["stage3_param_persistence_threshold"] == 640
    assert ds["zero_allow_untested_optimizer"] is True  # grpokit's torch optimizer
    assert zero3_config(_targs(max_grad_norm=0), 64, 2)["gradient_clipping"] == 0.0  # 0 turns clipping off
    offload = zero3_config(_targs(deepspeed="zero3_offload"), 64, 2)
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert offload["zero_force_ds_cpu_optimizer"] is False
    assert "auto" not in json.dumps(offload)
    assert PRESETS["zero3"]["reduce_bucket_size"] == "auto"  # a copy was filled, not the preset


def test_zero3_json_file_autos_and_clashes(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
                               "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto"}))
    ds = zero3_config(_targs(deepspeed=str(cfg)), 32, 2)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 32 * 32 and ds["bf16"]["enabled"] is False
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 16}))
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu 16 in the file differs"):
        zero3_config(_targs(deepspeed=str(cfg)), 32, 2)
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}}))
    with pytest.raises(ConfigError, match="drop the \"optimizer\" section"):
        zero3_config(_targs(deepspeed=str(cfg)), 32, 2)
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}))
    with pytest.raises(ConfigError, match="cannot fill \"auto\" for zero_optimization.sub_group_size"):
        zero3_config(_targs(deepspeed=str(cfg)), 32, 2)
    cfg.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        zero3_config(_targs(deepspeed=str(cfg)), 32, 2)


def test_zero3_refuses_gradient_accumulation_and_one_process():
    from accelerate.utils import DistributedType
    import torch

    from grpokit.trainers.distributed import accelerate_plugins, check_backend

    with pytest.raises(ConfigError, match="--gradient_accumulation_steps 2 is not implemented"):
        zero3_config(_targs(gradient_accumulation_steps=2), 64, 2)
    assert accelerate_plugins(SimpleNamespace(deepspeed="zero3", fsdp=False)) == {}  # grpokit drives it
    one = SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1, device=torch.device("cpu"))
    args = SimpleNamespace(deepspeed="zero3", fsdp=False)
    with pytest.raises(ConfigError, match="partitions the weights over processes, here 1 process"):
        check_backend(one, args)
    two = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2, device=torch.device("cpu"))
    check_backend(two, args)  # ZeRO-3 on CPU: fine


def test_zero3_refuses_vllm_colocate():
    import torch

    from grpokit.trainers.training_setup import setup_rollout

    policy = torch.nn.Linear(2, 2)
    policy.weight.ds_id = 0  # what ZeRO-3 marks its partitioned parameters with
    cfg = SimpleNamespace(training=SimpleNamespace(deepspeed="zero3"))
    with pytest.raises(ConfigError, match="ZeRO-3 with a vllm engine is not implemented"):
        setup_rollout(SimpleNamespace(engine_type="vllm"), None, policy, None, cfg, None)
