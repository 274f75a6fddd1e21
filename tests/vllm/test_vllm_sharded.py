"""vLLM colocate with several training processes: 2 gloo processes under torchrun, each with its own in-process
vLLM engine (joined to the launcher's group with vLLM's ``external_launcher``), training 3 steps with
``--deepspeed zero3`` or ``--fsdp`` (full weights, and LoRA under ZeRO-3) or plain DDP. After every weight sync
each rank's engine greedy output equals the greedy output of the trainer's own weights (gathered from the
partitions/shards into a plain copy, parameter by parameter), and by the last step it has moved from the
initial one."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from support import QUIET, flags

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from cli_process import run_grpokit, run_grpokit_ranks  # noqa: E402

pytestmark = pytest.mark.vllm

PLUGIN = textwrap.dedent('''
    """Per-rank greedy checks after each weight sync (tests/vllm/test_vllm_sharded.py)."""
    import json
    import os

    import torch

    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.engines.weights import is_peft_model, iter_sync_weights, whole_weight
    from grpokit.protocol import RequestConfig, RolloutInferRequest
    from grpokit.rewards import ORM, orms
    from grpokit.trainers.factory import TrainerFactory
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    PROMPTS = [RolloutInferRequest(messages=[{"role": "user", "content": f"What is {i} + 3?"}]) for i in range(2)]
    GREEDY = RequestConfig(max_tokens=10, temperature=0)


    class LengthReward(ORM):
        def __call__(self, completions, **kwargs):
            return [len(c) / 50.0 for c in completions]


    orms["test_length"] = LengthReward


    def _greedy(engine, pad):
        ids = [r.choices[0].token_ids for r in engine.infer(PROMPTS, GREEDY)]
        return [seq[: seq.index(pad)] if pad in seq else seq for seq in ids]


    class SyncCheck(GRPOTrainer):
        """Dumps, per rank, the engine's greedy ids at the start and after each sync, and those of a plain copy of
        the trainer's weights."""

        def _dump(self, row):
            path = os.path.join(os.environ["GRPOKIT_TEST_DUMP"], f"rank{os.environ.get('RANK', '0')}.jsonl")
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\\n")

        def _plain_copy(self):
            from transformers import AutoModelForCausalLM

            copy = AutoModelForCausalLM.from_pretrained(os.environ["GRPOKIT_TEST_MODEL"], dtype=torch.float32)
            if is_peft_model(self.policy):  # LoRA: the merged weights (checked against peft's merge elsewhere)
                state = {n: t.cpu() for n, t in iter_sync_weights(self.policy, stable=True)}
            else:  # full weights: gathered one parameter at a time, independently of the engine's sync
                state = {}
                for name, p in self.policy.named_parameters():
                    with whole_weight(p) as w:
                        state[name] = w.cpu().clone()
            missing, unexpected = copy.load_state_dict(state, strict=False)
            assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
            return copy

        def train(self):
            pad = self.engine.template.pad_token_id
            self._dump({"kind": "initial", "engine": _greedy(self.engine, pad)})
            return super().train()

        def _sync_weights(self):
            seconds = super()._sync_weights()  # the loop logs it as timing/sync
            pad = self.engine.template.pad_token_id
            reference = TransformersEngine(self._plain_copy(), self.engine.template)
            self._dump({"kind": "sync", "step": self.state.global_step, "engine": _greedy(self.engine, pad),
                        "trainer": _greedy(reference, pad), "engine_type": self.engine.engine_type})
            return seconds


    TrainerFactory.TRAINER_MAPPING["grpo"] = "vllm_sharded_plugin.SyncCheck"
''')
LORA = flags("--tuner_type lora --lora_rank 4 --lora_alpha 8 --target_modules all-linear --learning_rate 3e-2")


def _train(model: Path, root: Path, *extra: str, processes: int = 2) -> list[list[dict]]:
    """Train under torchrun with ``processes`` processes, or in one process without a launcher (0); each rank's
    dumped checks."""
    plugin, dump = root / "vllm_sharded_plugin.py", root / "dump"
    plugin.write_text(PLUGIN)
    dump.mkdir(parents=True)
    args = flags(
        {"--model": model, "--external_plugins": plugin, "--output_dir": root / "out"},
        "--dataset builtin:arithmetic --reward_funcs test_length --max_steps 3 --num_generations 4",
        "--per_device_train_batch_size 4 --max_completion_length 10 --learning_rate 5e-3 --beta 0",
        "--torch_dtype float32 --temperature 0.9 --use_vllm true --vllm_mode colocate --vllm_enforce_eager true",
        "--vllm_max_model_len 256 --vllm_gpu_memory_utilization 0.3 --vllm_max_num_seqs 8",
        QUIET,
        *extra,
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GRPOKIT_TEST_DUMP": str(dump),
        "GRPOKIT_TEST_MODEL": str(model),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    # torchrun's ranks (or one process without a launcher), forked from the test zygote (cli_process.py)
    if processes:
        proc = run_grpokit_ranks(["train", *args], processes, env=env, timeout=900)
    else:
        env = {
            k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        }
        proc = run_grpokit(["train", *args], env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [
        [json.loads(line) for line in (dump / f"rank{r}.jsonl").read_text().splitlines()]
        for r in range(max(processes, 1))
    ]


@pytest.mark.parametrize(
    "sharding", [("--deepspeed", "zero3"), ("--deepspeed", "zero3", *LORA)], ids=["zero3", "zero3-lora"]
)
def test_each_rank_engine_follows_the_sharded_trainer(tiny128, tmp_path, sharding):
    """ZeRO-3 here; FSDP and plain DDP in test_vllm_sharded_fsdp_ddp.py (a file of their own, so that pytest-xdist
    runs them beside these: whole files go to one worker)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed extra (pip install 'grpokit[deepspeed]')")
    ranks = _train(tiny128, tmp_path, *sharding)
    _check_engines_follow(ranks)


def test_zero3_in_one_process_without_a_launcher(tiny128, tmp_path):
    """ms-swift's one-GPU recipe, `--deepspeed zero3 --use_vllm true` run as a plain command: vLLM forms the
    one-process group as it starts, and DeepSpeed runs in it."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed extra (pip install 'grpokit[deepspeed]')")
    _check_engines_follow(_train(tiny128, tmp_path, "--deepspeed", "zero3", processes=0))


def _check_engines_follow(ranks: list[list[dict]]) -> None:
    for rows in ranks:
        initial = [r for r in rows if r["kind"] == "initial"]
        syncs = [r for r in rows if r["kind"] == "sync"]
        print("rank checks:", [(s["step"], s["engine"] == s["trainer"]) for s in syncs])
        assert len(initial) == 1 and [s["step"] for s in syncs] == [1, 2, 3]  # one sync per optimizer step
        assert all(s["engine_type"] == "vllm" for s in syncs)
        assert all(s["engine"] == s["trainer"] for s in syncs)
        assert syncs[-1]["engine"] != initial[0]["engine"]  # the weights did move, and the engine with them
    assert all(rows[-1]["engine"] == ranks[0][-1]["engine"] for rows in ranks)  # every rank's engine: same weights
