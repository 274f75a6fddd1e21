"""A fake fast engine for the episode-route tests: it answers on the planned prompt ids, as the real one does."""

from __future__ import annotations

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
