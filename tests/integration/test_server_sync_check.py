"""The weight-sync check in server mode (tiny model, transformers engine, float32 on both sides): an intact run's
check passes at every sync; one bucket corrupted, or one bucket not loaded, on the server's receiving side (the
test plugin sync_fault_plugin.py) stops the run at that step with one line naming the bucket and the tensor."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from support import flags
from test_server_support import rollout_server

from grpokit.config.parse import parse_train_args
from grpokit.errors import WeightSyncError
from grpokit.testing import build_tiny_model

pytestmark = pytest.mark.slow

PLUGIN = Path(__file__).with_name("sync_fault_plugin.py")
CHECK_LOGGER = "grpokit.engines.sync_check.probe"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory, fault_file):
    with rollout_server(
        tiny,
        tmp_path_factory.mktemp("logs"),
        "--torch_dtype",
        "float32",
        "--external_plugins",
        str(PLUGIN),
        env={"GRPOKIT_TEST_SYNC_FAULT_FILE": str(fault_file)},
    ) as s:
        yield s


def _train(tiny, server, out: Path, steps: int):
    from grpokit.pipeline.train import run_train

    cfg = parse_train_args(
        flags(
            "--model",
            str(tiny),
            "--tuner_type full --dataset builtin:arithmetic --reward_funcs accuracy",
            "--vllm_mode server --vllm_server_host 127.0.0.1",
            "--vllm_server_port",
            str(server.port),
            "--max_steps",
            str(steps),
            "--num_generations 4 --per_device_train_batch_size 4 --max_completion_length 4",
            "--torch_dtype float32 --learning_rate 1e-4",
            "--output_dir",
            str(out),
            # every step moves the weights (AdamW's decay), even when all rewards are equal
            "--weight_decay 0.1 --save_final_model false --vllm_server_timeout 60",
            "--report_to none",
        )
    )
    return run_train(cfg)


def _passed(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == CHECK_LOGGER and "passed" in r.getMessage()]


def test_an_intact_run_passes_the_check_at_every_sync(tiny, server, fault_file, tmp_path, caplog):
    fault_file.write_text("none")
    with caplog.at_level(logging.INFO, logger=CHECK_LOGGER):
        trainer = _train(tiny, server, tmp_path / "ok", steps=2)
    lines = _passed(caplog)
    # one sync before the first step (the server may hold other weights), then one after each step
    assert [line.split(" passed")[0] for line in lines] == [f"weight sync check after step {s}" for s in (0, 1, 2)]
    assert trainer.state.global_step == 2
    assert all("0 not readable back" in line and "probe max |Δ logp|" in line for line in lines), lines


@pytest.mark.parametrize("fault", ["corrupt", "drop"])
def test_a_broken_bucket_stops_the_run_at_that_step_naming_it(tiny, server, fault_file, tmp_path, caplog, fault):
    fault_file.write_text(f"{fault}:0:2")  # the group's 2nd sync: the one after step 1
    with caplog.at_level(logging.INFO, logger=CHECK_LOGGER), pytest.raises(WeightSyncError) as info:
        _train(tiny, server, tmp_path / fault, steps=3)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"weight sync check: server 127.0.0.1:{server.port} does not hold the weights just sent: bucket 0 of 1: "
    )
    assert "[sync after step 1; --check_weight_sync false turns the check off]" in message
    if fault == "corrupt":  # the bucket's first tensor, named with the sum that moved
        assert "model.embed_tokens.weight (" in message, message
    else:  # every tensor the step changed holds the old values
        assert "tensors" in message, message
    assert len(_passed(caplog)) == 1  # the sync before step 1 passed; the run stopped at the next
