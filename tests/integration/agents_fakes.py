"""A fake fast engine for the episode-route tests: it answers on the planned prompt ids, as the real one does."""

from __future__ import annotations

from pathlib import Path

from support import write_jsonl

from grpokit.agents.engine import CANCEL, PROMPT_IDS
from grpokit.engines.base import InferEngine
from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RequestConfig, RolloutInferRequest


def tiny_template(model_dir, **kwargs):
    """The tiny model's chat template (``kwargs``: ChatTemplate's, e.g. ``max_length``)."""
    from grpokit.modeling import load_tokenizer  # not at the top: only the tests that render load a tokenizer
    from grpokit.template.encode import ChatTemplate

    return ChatTemplate(load_tokenizer(model_dir), **kwargs)


class EchoEngine(InferEngine):
    """Answers each call with ``ack <the last message's content>`` (or a scripted text), on the planned ids."""

    takes_prompt_ids = True

    def __init__(self, template, script: str | None = None, stall: str | None = None) -> None:
        super().__init__()
        self.template, self.tokenizer, self.script = template, template.tokenizer, script
        self.stall = stall  # a call whose last message is this generates until its episode ends
        self.calls = 0
        self.cancelled = 0

    def infer(self, requests: list[RolloutInferRequest], config: RequestConfig) -> list[ChatCompletionResponse]:
        out = []
        for r in requests:
            self.calls += 1
            if self.stall is not None and r.messages[-1]["content"] == self.stall:
                self.cancelled += r.data_dict[CANCEL].wait(60)  # as the engine's per-token check of the event
            text = self.script or f"ack {r.messages[-1]['content']}"[:200]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            ids = ids[-config.max_tokens :]
            choices = [
                ChatCompletionResponseChoice(
                    index=k,
                    message={"role": "assistant", "content": text},
                    finish_reason="stop",
                    token_ids=ids,
                    logprobs={"content": [{"token_id": t, "logprob": -0.5} for t in ids]},
                )
                for k in range(config.n)
            ]
            prompt = r.data_dict.get(PROMPT_IDS) or self.template.encode_prompt(r.messages)
            out.append(ChatCompletionResponse(choices=choices, prompt_token_ids=prompt))
        return out


def agent_run_argv(model_dir: Path, tmp_path: Path, plugin: str, agent: str, steps: int, *extra: str):
    """(``grpokit train`` arguments, output folder) of a tiny --agent run: 4 arithmetic rows, 2 episodes each,
    ``plugin`` (the agent's source) loaded with --external_plugins."""
    rows = [
        {
            "messages": [{"role": "user", "content": f"What is {a} * {b}?"}],
            "expression": f"{a} * {b}",
            "extra_calls": (a + b) % 3,
        }
        for a, b in ((2, 3), (4, 5), (6, 7), (8, 9))
    ]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    path = tmp_path / f"{agent}_plugin.py"
    path.write_text(plugin)
    out = tmp_path / "out"
    flags = {
        "model": model_dir,
        "tuner_type": "full",  # written for full fine-tuning (the default is lora)
        "dataset": data,
        "output_dir": out,
        "max_steps": steps,
        "num_generations": 2,
        "per_device_train_batch_size": 4,
        "max_completion_length": 8,
        "learning_rate": 1e-3,
        "beta": 0,
        "torch_dtype": "float32",
        "seed": 0,
        "disable_tqdm": "true",
        "plots": "false",
        "save_final_model": "false",
        "agent": agent,
        "external_plugins": path,
        "agent_timeout": 120,
    }
    return [a for k, v in flags.items() for a in (f"--{k}", str(v))] + list(extra), out
