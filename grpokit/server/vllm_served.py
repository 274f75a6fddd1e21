"""``grpokit rollout --engine vllm``: the vLLM engine with the server's request checks (imported only then).

A disconnected client's requests are dropped only while they wait for the engine (not once their batch is
generating), and the context check runs here, before vLLM sees the batch. The batch is stepped so that a weight
update can pause it and continue it on the new weights (engines/partial/vllm_steps.py). With
``--vllm_enable_lora true`` vLLM starts with LoRA enabled and adapter-only syncs become versions of their own
(engines/vllm_adapters.py, ``ServedVllmAdapters``): a request samples the version its ``weight_version`` names,
the newest where it names none.
"""

from __future__ import annotations

from grpokit.engines.adapters import AdapterSync, is_adapter_name
from grpokit.engines.partial.vllm_steps import VllmPartialRollouts
from grpokit.engines.transformers_engine import context_message
from grpokit.engines.vllm_adapters import ServedVllmAdapters
from grpokit.engines.vllm_engine import VllmEngine, VllmSettings
from grpokit.errors import ConfigError, DataError
from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RequestConfig
from grpokit.server.engine import ASKED, CancellableRequests
from grpokit.wire.weights import parse_dtype


class ServedVllmEngine(CancellableRequests, VllmPartialRollouts, VllmEngine):
    def __init__(self, model_path: str, settings: VllmSettings, lora: tuple[int, int] | None = None) -> None:
        """``lora``: (max rank, max versions loaded) of the LoRA adapters served (None: vLLM starts without LoRA)."""
        # vLLM starts with enable_lora, max_lora_rank and max_loras (engines/vllm_adapters.py); the colocate sync
        # of AdapterSync is never called here: versions come from the weight group (serve_adapters)
        sync = AdapterSync(True, lora[0], "the rollout server", keep=lora[1]) if lora else None
        super().__init__(model_path, settings, lora=sync)
        self._lora = lora
        self._init_cancel()
        self._init_partial()  # an update may pause a batch and continue it (the app tags the version it loaded)
        self.max_model_len = self._context_length()
        self.dtype = parse_dtype(self.dtype_name)
        self.adapters: ServedVllmAdapters | None = None  # LoRA versions, once serve_adapters ran

    @classmethod
    def build(
        cls,
        model_path: str,
        dtype: str,
        max_num_seqs: int,
        max_model_len: int | None,
        extra: dict,
        lora: tuple[int, int] | None = None,
    ) -> ServedVllmEngine:
        settings = VllmSettings(dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len, **extra)
        return cls(model_path, settings, lora)

    def serve_adapters(self, max_rank: int) -> None:
        """Accept adapter-only weight syncs: LoRA factors up to rank ``max_rank``, each sync a LoRA version."""
        if self._lora is None:
            raise ConfigError("--vllm_enable_lora true: this vLLM engine was started without LoRA")
        self.adapters = ServedVllmAdapters(self, min(max_rank, self._lora[0]), self._lora[1])

    def _sampling(self, resumed: bool = False) -> tuple:
        """The version the request asked for (``RequestConfig.weight_version``; the newest where none, and after a
        weight update paused the call), its LoRARequest, and its tokens' tag."""
        if self.adapters is None:
            return None, self.policy_version
        asked = None if resumed else ASKED.get()
        tag = asked if asked is not None and self.policy_version is not None else self.policy_version
        return self.adapters.request(asked), tag

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
        asked = self._hold(config.weight_version)
        token = ASKED.set(config.weight_version)
        try:
            out = super().infer([requests[i] for i in live], config) if live else []
        finally:
            ASKED.reset(token)
            self._release(asked)
            self._forget(requests)
        answers = dict(zip(live, out, strict=True))
        gone = ChatCompletionResponseChoice(
            message={"role": "assistant", "content": ""}, finish_reason="stop", token_ids=[]
        )
        return [answers.get(i) or ChatCompletionResponse(choices=[gone]) for i in range(len(requests))]

    def tensor_count(self) -> int:
        """Parameters a weight sync may name (the Hugging Face names of the served model; with adapters, two LoRA
        factors per matrix)."""
        shapes = self._hf_shapes()
        factors = 2 * sum(len(s) == 2 for s, _ in shapes.values()) if self.adapters is not None else 0
        return len(shapes) + factors

    def state_keys(self) -> list[str]:
        """The names a weight sync may send (ms-swift's GET /get_model_state_keys/)."""
        return list(self._hf_shapes())

    def check_weights(self, metas) -> list[str]:
        """As the vLLM engine's, but an unknown name ends the check at once (the only problem reported)."""
        known = self._hf_shapes()
        factors = [m for m in metas if is_adapter_name(m.name)]
        if factors and self.adapters is None:
            return [f"{factors[0].name}: this server was started with --vllm_enable_lora false"]
        unknown = next((m for m in metas if m.name not in known and not is_adapter_name(m.name)), None)
        if unknown is not None:
            return [f"{unknown.name}: no such parameter in the served model"]
        problems = [p for p in (self.adapters.check(m.name, list(m.shape)) for m in factors) if p]
        return problems + super().check_weights([m for m in metas if not is_adapter_name(m.name)])

    def load_weights(self, named) -> None:
        """As the vLLM engine's; during an adapter-only update, the LoRA factors go to the version being staged."""
        if self.adapters is not None and self.adapters.staging:
            named = self.adapters.load(named)
        super().load_weights(named)

    def weight_sums(self, names: list[str]) -> dict:
        """As the vLLM engine's; LoRA factors read back from the newest version's folder, which vLLM loaded."""
        if self.adapters is None:
            return super().weight_sums(names)
        plain = [n for n in names if not is_adapter_name(n)]
        factors = self.adapters.held_sums([n for n in names if is_adapter_name(n)])
        return {**(super().weight_sums(plain) if plain else {}), **factors}

    def info(self) -> dict:
        lora = None if self.adapters is None else self.adapters.max_rank  # None: adapter-only syncs refused
        versions = None if self.adapters is None else self.adapters.loaded
        return {**super().info(), "max_model_len": self.max_model_len, "max_lora_rank": lora, "lora_versions": versions}
