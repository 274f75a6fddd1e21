"""A checkpoint folder is data: planted pickle payloads are refused by the failure diagnosis without running,
entries that are not regular files are refused before anything opens them, args.json is bounded, and
accelerate's RNG file is read as data and checked after the load (never skipped without a word)."""

from __future__ import annotations

import json
import os
import pickle
import random
import socket

import numpy as np
import pytest
import torch

from grpokit.errors import ConfigError
from grpokit.runs import checkpoints as ck
from grpokit.runs.checkpoint_files import check_rng_restored, rng_state
from grpokit.runs.pickle_scan import check_pickles
from grpokit.runs.run_args import read_args


def _checkpoint(out, step: int = 2):
    ckpt = out / f"checkpoint-{step}"
    tmp = ck.temporary_dir(ckpt)
    (tmp / "state").mkdir(parents=True)
    torch.save({"state": {}, "param_groups": []}, tmp / "state" / "optimizer.bin")
    torch.save(_rng_states(), tmp / "state" / "random_states_0.pkl")
    ck.finish_checkpoint(tmp, ckpt, {"global_step": step, "prompts_consumed": 2 * step, "max_steps": 9})
    return ckpt


def _rng_states() -> dict:
    """What accelerate's save_state writes (on CPU)."""
    return {
        "step": 0,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_the_failure_diagnosis_refuses_planted_payloads_without_running_them(tmp_path):
    ckpt = _checkpoint(tmp_path)
    marker = tmp_path / "ran"
    torch.save({"x": _Payload(marker)}, ckpt / "state" / "custom_checkpoint_0.bin")
    (ckpt / "state" / "extra.pkl").write_bytes(pickle.dumps(_Payload(marker)))
    torch.save([_Payload(marker)], ckpt / "weights.pt")
    err = str(ck.load_error(ckpt, RuntimeError("boom")))
    assert not marker.exists()
    assert "custom_checkpoint_0.bin is unreadable (custom_checkpoint_0/data.pkl: it would import posix.system" in err
    assert "posix.system" in err and "extra.pkl is unreadable" in err
    assert "weights_only" not in err and "\n" not in err
    # accelerate's own RNG file (torch.save output with numpy state) reads as data: never blamed
    (ckpt / "state" / "optimizer.bin").write_bytes(b"\0garbage")
    for planted in ("custom_checkpoint_0.bin", "extra.pkl"):
        (ckpt / "state" / planted).unlink()
    (ckpt / "weights.pt").unlink()
    err = str(ck.load_error(ckpt, RuntimeError("boom")))
    assert "optimizer.bin is unreadable" in err and "random_states" not in err, err


@pytest.mark.parametrize("kind", ["fifo", "symlink", "socket", "dangling"])
def test_an_entry_that_is_not_a_regular_file_is_refused_before_it_is_opened(tmp_path, kind):
    ckpt = _checkpoint(tmp_path)
    target = ckpt / "state" / "scheduler.bin"
    outside = tmp_path / "secret"
    outside.write_text("x")
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "symlink":
        target.symlink_to(outside)
    elif kind == "dangling":
        (ckpt / "state").joinpath("sub").mkdir()
        (ckpt / "state" / "sub" / "x").symlink_to(tmp_path / "nowhere")
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(target))
        sock.close()
    what = {"fifo": "a FIFO", "symlink": "a symlink", "socket": "a socket", "dangling": "a symlink"}[kind]
    with pytest.raises(ConfigError, match=f"is {what}, not a regular file"):
        ck.check_checkpoint(ckpt)
    with pytest.raises(ConfigError, match=f"--resume_from_checkpoint {ckpt}: .* is {what}"):
        ck.resolve_resume(tmp_path, str(ckpt))
    assert ck.latest_checkpoint(tmp_path)[0] is None  # `latest` skips it, saying why


def test_a_state_file_that_is_a_fifo_or_a_symlink_is_refused(tmp_path):
    ckpt = _checkpoint(tmp_path)
    state = ckpt / ck.STATE_FILE
    text = state.read_text()
    state.unlink()
    (tmp_path / "elsewhere.json").write_text(text)
    state.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ConfigError, match="trainer_state.json is a symlink"):
        ck.read_state(ckpt)
    state.unlink()
    os.mkfifo(state)
    with pytest.raises(ConfigError, match="trainer_state.json is a FIFO"):
        ck.read_state(ckpt)


@pytest.mark.parametrize(
    "content, why",
    [
        ("[" * 100_000 + "]" * 100_000, "nests deeper than 32"),
        ('{"a": ' + "[" * 40 + "]" * 40 + "}", "nests deeper than 32"),
        ('{"a": "' + "x" * (5 << 20) + '"}', "larger than"),
        ("[1, 2]", "not an object of options"),
        ("{", "not valid JSON"),
    ],
)
def test_a_hostile_args_json_is_one_line(tmp_path, content, why):
    path = tmp_path / "args.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=why) as e:
        read_args(path)
    assert "\n" not in str(e.value) and "restore it or delete it" in str(e.value)


def test_the_rng_file_is_read_as_data_and_checked_after_the_load(tmp_path):
    ckpt = _checkpoint(tmp_path)
    path = ckpt / "state" / "random_states_0.pkl"
    states = rng_state(ckpt / "state", 0)
    check_rng_restored(states, path)  # the states in effect are the file's
    random.random()
    with pytest.raises(ConfigError, match="random_states_0.pkl .* could not be set"):
        check_rng_restored(states, path)  # what accelerate's silent skip leaves
    path.write_bytes(b"\0" * path.stat().st_size)
    with pytest.raises(ConfigError, match=r"random_states_0.pkl \(the RNG states\) does not load"):
        rng_state(ckpt / "state", 0)
    torch.save({"random_state": "x"}, path)
    with pytest.raises(ConfigError, match="does not hold accelerate's RNG states"):
        rng_state(ckpt / "state", 0)
    torch.save(_Payload(tmp_path / "ran"), path)
    with pytest.raises(ConfigError, match="refused without running it"):
        rng_state(ckpt / "state", 0)
    assert not (tmp_path / "ran").exists()
    path.unlink()
    with pytest.raises(ConfigError, match="random_states_0.pkl is missing"):
        rng_state(ckpt / "state", 0)


def test_state_fields_keep_a_checkpoint_inside_its_folder(tmp_path):
    ckpt = _checkpoint(tmp_path)
    state = json.loads((ckpt / ck.STATE_FILE).read_text())
    state["files"]["../secret"] = 1
    (ckpt / ck.STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(ConfigError, match="files is .*not relative paths inside the checkpoint"):
        ck.check_checkpoint(ckpt)


@pytest.mark.parametrize("proto", range(pickle.HIGHEST_PROTOCOL + 1))
def test_the_pickle_scan_refuses_a_payload_in_any_protocol_without_running_it(tmp_path, proto):
    """What DeepSpeed (torch.load(weights_only=False)) and torch.distributed.checkpoint (pickle.load) would run:
    refused before they are called, in any pickle protocol, inside a torch zip file, after other pickles."""
    ckpt, marker = _checkpoint(tmp_path), tmp_path / "ran"
    check_pickles(ckpt)  # accelerate's own files (optimizer, RNG states with numpy) pass
    target = ckpt / "state" / "deepspeed" / "mp_rank_00_model_states.pt"
    target.parent.mkdir()
    for payload in (
        pickle.dumps({"w": [_Payload(marker)]}, protocol=proto),
        pickle.dumps(1, protocol=proto) + pickle.dumps(_Payload(marker), protocol=proto),  # a later pickle
    ):
        target.write_bytes(payload)
        with pytest.raises(ConfigError, match=r"mp_rank_00_model_states.pt would import posix.system to load"):
            check_pickles(ckpt)
    torch.save({"w": _Payload(marker)}, target)
    with pytest.raises(ConfigError, match=r"\(mp_rank_00_model_states/data.pkl\) would import posix.system"):
        check_pickles(ckpt)
    assert not marker.exists()


def test_the_pickle_scan_lets_tensors_numpy_and_checkpoint_metadata_through(tmp_path):
    import torch.distributed.checkpoint as dcp  # noqa: F401 - its metadata classes are the ones a .metadata holds

    ckpt = _checkpoint(tmp_path)
    torch.save({"w": torch.zeros(2, dtype=torch.bfloat16), "n": np.arange(3), "s": torch.Size([2])}, ckpt / "a.pt")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(ckpt / "state" / "sharded"), no_dist=True)
    check_pickles(ckpt)
    (ckpt / "evil.bin").write_bytes(b"cbuiltins\neval\n(Vprint(1)\ntR.")  # protocol 0, no header
    with pytest.raises(ConfigError, match="evil.bin would import builtins.eval"):
        check_pickles(ckpt)
