"""The one-process group that --deepspeed forms without a launcher (distributed/zero.py): released at the end of a run
with the launcher variables it set, so a caller can run again in the same process; a launcher's group is left
alone. The DeepSpeed runs themselves, and a trainer's failing set-up: tests/integration/test_deepspeed_stages.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from grpokit.distributed import zero

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_launcher(monkeypatch):
    for key in LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():  # a failing test leaves no group to the next one
        dist.destroy_process_group()


def test_group_formed_without_a_launcher_is_released_with_its_variables(no_launcher):
    for _ in range(2):  # a second run in the same process forms a fresh group
        lease = zero.ensure_process_group(torch.device("cpu"))
        assert lease.held and lease.owned
        assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("0", "0", "1")
        assert not zero.ensure_process_group(torch.device("cpu")).held  # a second call: the group is there
        lease.release()
        assert not dist.is_initialized() and not lease.held
        assert [k for k in LAUNCHER_VARS if k in os.environ] == []
    lease.release()  # twice: nothing left to release


def test_variables_set_before_are_kept_and_put_back(no_launcher, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # set by the caller: used, and still set afterwards
    lease = zero.ensure_process_group(torch.device("cpu"))
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["MASTER_PORT"].isdigit()
    lease.release()
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and "MASTER_PORT" not in os.environ


def test_a_group_formed_by_someone_else_is_left_alone(no_launcher, tmp_path):
    """vLLM colocate's one-process group (no launcher variables): used with the variables DeepSpeed needs, which
    are taken back at the end; the group stays its owner's."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    lease = zero.ensure_process_group(torch.device("cpu"))  # reuses it
    assert lease.held and not lease.owned and os.environ["LOCAL_RANK"] == "0"
    lease.release()
    assert dist.is_initialized()  # its owner destroys it, not grpokit
    assert "RANK" not in os.environ


def test_a_failing_set_up_releases_the_group_it_formed(no_launcher):
    lease = zero.ensure_process_group(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="set-up"), zero.released_on_error(lease):
        raise RuntimeError("a set-up step failed")
    assert not dist.is_initialized() and "LOCAL_RANK" not in os.environ


def test_deepspeed_precision_modes_are_refused_and_auto_is_off(tmp_path):
    """DeepSpeed's own bf16/fp16 mode casts the weights (float32 copies only in its optimizer) and drifts from DDP
    and --fsdp (KL 1.7-5% apart at steps 2-3 on the tiny model, docs/distributed.md "Precision"): refused; "auto"
    and false keep grpokit's precision (float32 weights, --torch_dtype's autocast)."""
    import json
    from types import SimpleNamespace

    from grpokit.errors import ConfigError

    def config(sections: dict) -> dict:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 3}, **sections}))
        args = SimpleNamespace(
            deepspeed=str(path), per_device_train_batch_size=4, gradient_accumulation_steps=1, max_grad_norm=1.0
        )
        return zero.deepspeed_config(args, 32, 2)

    ds = config({"bf16": {"enabled": "auto"}, "fp16": {"enabled": False, "loss_scale": 0}, "bfloat16": {}})
    assert ds["bf16"]["enabled"] is False and ds["fp16"] == {"enabled": False, "loss_scale": 0}
    for section, dtype in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
        with pytest.raises(
            ConfigError,
            match=rf"{section}\.enabled true would make DeepSpeed train {dtype} weights.*"
            rf"set it to \"auto\" or false and pass --torch_dtype {dtype}",
        ):
            config({section: {"enabled": True}})
    with pytest.raises(ConfigError, match=r'the "bf16" section must be a JSON object such as \{"enabled": "auto"\}'):
        config({"bf16": True})
