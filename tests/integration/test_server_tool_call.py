"""tool_call_scheduler inside the rollout server trains with the same token masks as in colocate mode
(tests/integration/test_multi_turn_train.py::test_tool_call_scheduler_masks_tool_results_in_the_batch)."""

from __future__ import annotations

import json
import textwrap

import pytest
from support import flags
from test_server_support import rollout_server

from grpokit.trainers.factory import TrainerFactory
from grpokit.trainers.grpo_trainer import GRPOTrainer

pytestmark = pytest.mark.slow

CANNED = "Action: calculator\nAction Input: 2*3"

# A random tiny model never writes an action, so the server's scheduler answers the first turn with a fixed one;
# later turns come from the live model on the server.
PLUGIN = textwrap.dedent(f"""
    from grpokit.engines.base import InferEngine
    from grpokit.rollout.builtin_schedulers import ToolCallScheduler
    from grpokit.rollout.multi_turn import multi_turns
    from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice

    TEXT = {CANNED!r}

    class CannedFirstTurn(InferEngine):
        def __init__(self, real):
            super().__init__()
            self.real, self.tokenizer, self.template = real, real.tokenizer, real.template
            self.ids = self.tokenizer(TEXT, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]

        def infer(self, requests, config):
            live = [r for r in requests if any(m["role"] == "assistant" for m in r.messages)]
            generated = iter(self.real.infer(live, config) if live else [])
            canned = ChatCompletionResponseChoice(message={{"role": "assistant", "content": TEXT}},
                                                  finish_reason="stop", token_ids=self.ids)
            return [next(generated) if r in live else ChatCompletionResponse(choices=[canned]) for r in requests]

    @multi_turns.register("canned_tool_call")
    class CannedToolCall(ToolCallScheduler):
        async def run(self, infer_request, request_config, **kwargs):
            if not isinstance(self.infer_engine, CannedFirstTurn):
                self.infer_engine = CannedFirstTurn(self.infer_engine)
            return await super().run(infer_request, request_config, **kwargs)
""")


class RecordingTrainer(GRPOTrainer):
    windows: list = []

    def _prepare_inputs(self, prompts, rollout=None):
        window = super()._prepare_inputs(prompts, rollout)
        RecordingTrainer.windows.append((window.outputs, window.batch))
        return window


def test_tool_call_masks_through_the_server_match_colocate(tiny_model_dir, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    plugin = tmp_path / "canned_plugin.py"
    plugin.write_text(PLUGIN)
    rows = [
        {"messages": [{"role": "user", "content": f"What is {a} * {b}?"}], "solution": str(a * b)}
        for a in (2, 3)
        for b in (3, 4)
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    saved = TrainerFactory.TRAINER_MAPPING["grpo"]
    TrainerFactory.TRAINER_MAPPING["grpo"] = RecordingTrainer
    RecordingTrainer.windows = []
    try:
        with rollout_server(
            tiny_model_dir,
            tmp_path,
            "--external_plugins",
            str(plugin),
            "--multi_turn_scheduler",
            "canned_tool_call",
            "--max_turns",
            "2",
        ) as server:
            trainer = run_train(
                parse_train_args(
                    flags(
                        "--model",
                        str(tiny_model_dir),
                        "--tuner_type full",
                        "--dataset",
                        str(data),
                        "--output_dir",
                        str(tmp_path / "out"),
                        "--max_steps 2 --num_generations 2 --per_device_train_batch_size 4",
                        "--max_completion_length 16 --learning_rate 1e-3 --beta 0 --reward_funcs format",
                        "--vllm_mode server --vllm_server_host 127.0.0.1",
                        "--vllm_server_port",
                        str(server.port),
                        "--vllm_server_timeout 60 --disable_tqdm true --plots false",
                        "--save_final_model false",
                    )
                )
            )
    finally:
        TrainerFactory.TRAINER_MAPPING["grpo"] = saved
    assert trainer.state.global_step == 2 and RecordingTrainer.windows
    tok = trainer.tokenizer
    canned = tok(CANNED, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    gap = tok("\n<|im_start|>user\nObservation: 6<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
        "input_ids"
    ]
    for outputs, batch in RecordingTrainer.windows:
        for i, o in enumerate(outputs):
            assert o.messages[2] == {"role": "user", "content": "Observation: 6"}
            second = o.response_token_ids[1]  # generated by the live model on the server
            n = len(canned) + len(gap) + len(second)
            c = batch.input_ids.shape[1] - batch.completion_mask.shape[1]
            assert batch.input_ids[i, c : c + n].tolist() == canned + gap + second
            assert batch.completion_mask[i, :n].tolist() == [1.0] * len(canned) + [0.0] * len(gap) + [1.0] * len(second)
            assert batch.completion_mask[i, n:].sum() == 0
