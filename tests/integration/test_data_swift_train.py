"""An ms-swift-style dataset and options train for 2 steps on the tiny model: a `question`/`answer` file with a
`tools` column, --system FILE.txt, --agent_template hermes, --max_length with left truncation, --columns."""

from __future__ import annotations

import json

import pytest
from support import flags, write_jsonl

pytestmark = pytest.mark.slow

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_swift_dataset_options_train_and_cut_prompts(tiny_model_dir, tmp_path, monkeypatch):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.template.encode import ChatTemplate

    rows = [
        {"Q": f"What is {a} + {b}? " + "Please think. " * (a * 3), "answer": str(a + b), "tools": json.dumps([WEATHER])}
        for a in range(1, 5)
        for b in range(1, 3)
    ]
    data = write_jsonl(tmp_path / "swift.jsonl", rows)
    (tmp_path / "system.txt").write_text("You are a calculator.")
    seen: list[tuple[list[dict], int]] = []
    encode_output = ChatTemplate.encode_output

    def spy(self, prompt_messages, output):
        sample = encode_output(self, prompt_messages, output)
        seen.append((prompt_messages, len(sample.prompt_ids)))
        return sample

    monkeypatch.setattr(ChatTemplate, "encode_output", spy)
    args = flags(
        {"--model": tiny_model_dir, "--dataset": data, "--output_dir": tmp_path / "out"},
        {"--columns": '{"q": "question"}', "--system": tmp_path / "system.txt"},
        "--tuner_type full --agent_template hermes --max_length 48 --truncation_strategy left --dataset_num_proc 1",
        "--load_from_cache_file false --num_generations 2 --per_device_train_batch_size 4",
        "--max_completion_length 4 --max_steps 2 --torch_dtype float32 --disable_tqdm true --plots false",
        "--save_final_model false",
    )
    trainer = run_train(parse_train_args(args))
    assert trainer.state.global_step == 2 and seen
    for messages, n_prompt in seen:
        system = messages[0]
        assert system["role"] == "system" and system["content"].startswith("You are a calculator.\n\n# Tools")
        assert '"get_weather"' in system["content"] and messages[1]["content"].startswith("What is")
        assert n_prompt == 48  # every prompt here renders to more than 48 tokens: cut to the last 48
    full = ChatTemplate(trainer.template.tokenizer).encode_prompt(seen[0][0])
    assert len(full) > 48
