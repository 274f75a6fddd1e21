"""``grpokit rollout --engine vllm``: the vLLM engine with the server's request checks (imported only then).

A disconnected client's requests are dropped only while they wait for the engine (not once their batch is
generating), and the context check runs here, before vLLM sees the batch. The batch is stepped so that a weight
update can pause it and continue it on the new weights (engines/partial/vllm_steps.py).
"""

from __future__ import annotations

from grpokit.engines.partial.vllm_steps import VllmPartialRollouts
from grpokit.engines.transformers_engine import context_message
from grpokit.engines.vllm_engine import VllmEngine, VllmSettings
from grpokit.errors import ConfigError, DataError
from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RequestConfig
from grpokit.server.engine import CancellableRequests


class ServedVllmEngine(CancellableRequests, VllmPartialRollouts, VllmEngine):
    def __init__(self, model_path: str, settings: VllmSettings) -> None:
        super().__init__(model_path, settings)
        self._init_cancel()
        self._init_partial()  # an update may pause a batch and continue it (the app tags the version it loaded)
        self.max_model_len = self._context_length()

    @classmethod
    def build(
        cls, model_path: str, dtype: str, max_num_seqs: int, max_model_len: int | None, extra: dict
    ) -> ServedVllmEngine:
        settings = VllmSettings(dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len, **extra)
        return cls(model_path, settings)

    def _context_length(self) -> int:
        for owner in (getattr(self.llm, "llm_engine", None), self.llm):
            config = getattr(owner, "model_config", None)
            if getattr(config, "max_model_len", None):
                return int(config.max_model_len)
        if self.settings.max_model_len:
            return int(self.settings.max_model_len)
        raise ConfigError("cannot tell vLLM's max_model_len; give --vllm_max_model_len N")

    def infer(self, requests, config: RequestConfig) -> list[ChatCompletionResponse]:
        try:
            if getattr(self.template, "multimodal", False):  # image tokens count: the processor's ids (memoised)
                prompts = [self.template.encode_request(r)[0] for r in requests]
            else:
                prompts = self.template.encode_requests(requests)  # memoised; a later turn: its pinned ids
        except DataError:  # more image placeholders than images: answered 400 as it is
            raise
        except Exception as e:  # noqa: BLE001 - a conversation the template cannot render
            raise ConfigError(
                f"the chat template cannot render these messages: {type(e).__name__}: {str(e)[:200]}"
            ) from e
        for i, p in enumerate(prompts):
            if len(p) + config.max_tokens > self.max_model_len:
                raise ConfigError(context_message(i, len(p), config.max_tokens, self.max_model_len))
        events = self.cancel_events(requests) or [None] * len(requests)
        live = [i for i, e in enumerate(events) if e is None or not e.is_set()]
        try:
            out = super().infer([requests[i] for i in live], config) if live else []
        finally:
            self._forget(requests)
        answers = dict(zip(live, out, strict=True))
        gone = ChatCompletionResponseChoice(
            message={"role": "assistant", "content": ""}, finish_reason="stop", token_ids=[]
        )
        return [answers.get(i) or ChatCompletionResponse(choices=[gone]) for i in range(len(requests))]

    def tensor_count(self) -> int:
        """Parameters a weight sync may name (the Hugging Face names of the served model)."""
        return len(self._hf_shapes())

    def state_keys(self) -> list[str]:
        """The names a weight sync may send (ms-swift's GET /get_model_state_keys/)."""
        return list(self._hf_shapes())

    def check_weights(self, metas) -> list[str]:
        """As the vLLM engine's, but an unknown name ends the check at once (the only problem reported)."""
        known = self._hf_shapes()
        unknown = next((m for m in metas if m.name not in known), None)
        if unknown is not None:
            return [f"{unknown.name}: no such parameter in the served model"]
        return super().check_weights(metas)

    def info(self) -> dict:
        return {**super().info(), "max_model_len": self.max_model_len}
