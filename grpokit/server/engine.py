"""The engine a rollout server owns: it loads the model, samples, and takes new weights in place.

Two things set a served engine apart from the trainer's: every request must fit in the context
(``max_model_len``: prompt + max_tokens, else ConfigError, answered 400), and a request whose HTTP client went away
is cancelled (``CANCEL`` holds the calling request's event; its rows stop at the next token).
"""

from __future__ import annotations

import threading
from contextvars import ContextVar

import torch

from grpokit.engines.adapter_store import AdapterVersions
from grpokit.engines.adapters import is_adapter_name
from grpokit.engines.grammar import GrammarLogitsProcessor, StructuredOutputs
from grpokit.engines.partial.served import PartialRollouts
from grpokit.engines.structured import request_limits
from grpokit.engines.transformers_engine import TransformersEngine, context_message
from grpokit.errors import ConfigError, DataError
from grpokit.protocol import ChatCompletionResponse, RequestConfig, RolloutInferRequest
from grpokit.wire.bodies import TensorMeta
from grpokit.wire.checksum import SumsOf
from grpokit.wire.weights import dtype_name, parse_dtype

# The event of the HTTP call being served (set when its client disconnects); the app sets it around each call.
CANCEL: ContextVar[threading.Event | None] = ContextVar("grpokit_cancel", default=None)
# The weight version the engine call under way asked for (RequestConfig.weight_version; None: the newest)
ASKED: ContextVar[int | None] = ContextVar("grpokit_weight_version", default=None)


class CancellableRequests:
    """Mixin: ``infer_async`` remembers the calling HTTP request's cancel event for each engine request, so that
    ``cancel_events`` can hand them to the sampler. Entries live until the batch holding them has run. A request
    whose rows the engine ended for its own reason (``_failed``, e.g. a grammar limit hit mid-generation) gets that
    reason raised as a ConfigError (answered 400) while the rest of its batch is answered as usual."""

    def _init_cancel(self) -> None:
        self._cancel: dict[int, tuple[RolloutInferRequest, threading.Event]] = {}
        self._failed: dict[int, tuple[RolloutInferRequest, str]] = {}  # id -> (request kept alive, why it ended)

    async def infer_async(self, request: RolloutInferRequest, config: RequestConfig) -> ChatCompletionResponse:
        # a request naming its weight version holds it from now: no sync unloads it while the request waits
        asked = (request.request_config or config).weight_version  # its own config wins, as in the batching
        held = self._hold(asked) if asked is not None else None
        event = CANCEL.get()
        if event is not None:
            self._cancel[id(request)] = (request, event)  # the request is kept alive: its id stays unique
        try:
            response = await super().infer_async(request, config)
        finally:
            self._cancel.pop(id(request), None)
            self._release(held)
        failed = self._failed.pop(id(request), None)
        if failed is not None:
            raise ConfigError(failed[1])
        return response

    def _hold(self, version: int | None) -> int | None:
        """Hold the LoRA version a call samples (engines/adapter_store.py): the one it names (ConfigError, answered
        400, naming it and the loaded ones where it is not loaded), else the newest; the version held."""
        adapters = getattr(self, "adapters", None)
        if adapters is None:
            if version is not None:
                raise ConfigError(
                    f"weight_version {version}: this server holds no LoRA versions (--vllm_enable_lora false); "
                    "leave it unset"
                )
            return None
        if version is None:
            version = adapters.latest
            adapters.hold(version)
        else:
            adapters.hold_loaded(version)
        return version

    def _release(self, version: int | None) -> None:
        if version is not None:
            self.adapters.release(version)

    def cancel_events(self, requests: list[RolloutInferRequest]) -> list | None:
        events = [self._cancel.get(id(r), (None, None))[1] for r in requests]
        return events if any(e is not None for e in events) else None

    def _forget(self, requests: list[RolloutInferRequest]) -> None:
        for r in requests:
            entry = self._cancel.get(id(r))
            if entry is not None and entry[1].is_set():
                self._cancel.pop(id(r), None)  # a cancelled call never comes back for it


class ServedTransformersEngine(CancellableRequests, PartialRollouts, TransformersEngine):
    """``TransformersEngine`` on a model of its own. ``lock`` keeps sampling and weight loading apart, so that no
    ``generate`` call ever sees half-updated weights."""

    def __init__(
        self,
        model,
        template,
        max_batch_size: int = 256,
        max_model_len: int | None = None,
        max_prefill_mb: float = 128.0,
        fast_decode: bool = True,
    ) -> None:
        super().__init__(model, template, max_batch_size=max_batch_size, fast_decode=fast_decode)
        self.max_prefill_bytes = int(max_prefill_mb * 1024 * 1024)
        self._init_cancel()
        self._init_partial()  # a weight update may pause generation and continue it on the new weights
        if isinstance(self.logits_processor_factory, StructuredOutputs):  # constraints come from requests
            try:
                self.logits_processor_factory.limits = request_limits()
            except ConfigError:  # llguidance is not installed: a constraint is refused when one comes
                pass
        self.lock = threading.Lock()
        model.requires_grad_(False).eval()
        # remove_duplicate=False: tied weights answer to both names (embed_tokens and lm_head)
        self._params = dict(model.named_parameters(remove_duplicate=False))
        first = next(iter(self._params.values()))
        self.dtype, self.device = first.dtype, first.device
        self.max_model_len = model_context(model, max_model_len)
        self.adapters: AdapterVersions | None = None  # LoRA versions (adapter-only syncs), once serve_adapters ran

    def serve_adapters(self, max_rank: int) -> None:
        """Accept adapter-only weight syncs (``--vllm_enable_lora``): LoRA factors up to rank ``max_rank``, each
        sync a version of its own (engines/adapter_store.py)."""
        self.adapters = AdapterVersions(self._params, max_rank)

    def infer(self, requests: list[RolloutInferRequest], config: RequestConfig) -> list[ChatCompletionResponse]:
        try:
            if getattr(self.template, "multimodal", False):  # the text path checks the context as it encodes
                self._check_mm_context(requests, config.max_tokens)
            with self.lock:
                held = self._hold(config.weight_version)  # stays loaded until the call ends
                inner = self.logits_processor_factory
                recorder = self.logits_processor_factory = _Recorder(inner) if inner is not None else None
                token = ASKED.set(config.weight_version)
                try:
                    if self.adapters is not None:  # the version asked for, else the newest, is the one served
                        self.adapters.activate(held)
                    out = super().infer(requests, config)
                finally:
                    ASKED.reset(token)
                    self.logits_processor_factory = inner
                    self._release(held)
            if recorder is not None:
                events = self.cancel_events(requests) or [None] * len(requests)
                for i, message in recorder.failed_rows(config.n).items():
                    if events[i] is None or not events[i].is_set():  # a cancelled call never comes back for it
                        self._failed[id(requests[i])] = (requests[i], message)
            return out
        finally:
            self._forget(requests)

    def _sampled_version(self, resumed: bool = False) -> int | None:
        """The tag of the tokens sampled now: the version the call asked for, or the newest (``resumed``: after a
        weight update paused the call, which continues on the newest version, made the one served)."""
        if resumed and self.adapters is not None:
            self.adapters.activate(self.adapters.latest)
        asked = None if resumed else ASKED.get()
        return asked if asked is not None and self.policy_version is not None else self.policy_version

    def _check_mm_context(self, requests: list[RolloutInferRequest], max_tokens: int) -> None:
        """ConfigError (answered 400) when a prompt, image tokens included, plus ``max_tokens`` does not fit.
        The processor's encoding is memoised, so sampling does not encode again."""
        for i, r in enumerate(requests):
            try:
                ids, _ = self.template.encode_request(r)
            except DataError:  # more image placeholders than images: answered 400 as it is
                raise
            except Exception as e:  # noqa: BLE001 - a conversation the template or processor cannot encode
                raise ConfigError(
                    f"request {i}: the processor cannot encode this prompt: {type(e).__name__}: {str(e)[:200]}"
                ) from e
            if len(ids) + max_tokens > self.max_model_len:
                raise ConfigError(context_message(i, len(ids), max_tokens, self.max_model_len))

    def tensor_count(self) -> int:
        """Tensors a weight sync may name (tied weights under each of their names; with adapters, two LoRA factors
        per matrix)."""
        factors = 2 * sum(p.dim() == 2 for p in self._params.values()) if self.adapters is not None else 0
        return len(self._params) + factors

    def state_keys(self) -> list[str]:
        """The names a weight sync may send (ms-swift's GET /get_model_state_keys/)."""
        return list(self._params)

    def check_weights(self, metas: list[TensorMeta]) -> list[str]:
        """Problems with loading these tensors (other shape, dtype that cannot cast); [] if none. An unknown name
        ends the check at once: it is the only problem reported."""
        problems = []
        for m in metas:
            if is_adapter_name(m.name):
                if self.adapters is None:
                    return [f"{m.name}: this server was started with --vllm_enable_lora false"]
                problem = self.adapters.check(m.name, list(m.shape))
                problems += [problem] if problem else []
                continue
            param = self._params.get(m.name)
            if param is None:
                return [f"{m.name}: no such parameter in the served model"]
            if list(param.shape) != list(m.shape):
                problems.append(f"{m.name}: shape {m.shape} but the served model has {list(param.shape)}")
            try:
                dtype = parse_dtype(m.dtype)
            except ValueError as e:
                problems.append(f"{m.name}: {e}")
                continue
            if dtype.is_floating_point != param.dtype.is_floating_point:
                problems.append(f"{m.name}: dtype {m.dtype} cannot load into {dtype_name(param.dtype)}")
        return problems

    @torch.no_grad()
    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model's parameters in place (casting dtype, moving device); during an adapter-only
        update, into the version being staged. Caller holds ``lock``."""
        if self.adapters is not None and self.adapters.staging:
            named = self.adapters.load(named)  # the factors staged, the base copied in place
        for name, tensor in named:
            self._params[name].data.copy_(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def weight_sums(self, names: list[str]) -> dict:
        """The weight-sync check: name → (checksums, dtype) of each parameter as the model holds it now, read
        back from the parameters (grpokit/wire/checksum.py); names it does not hold are left out."""
        held = {n: self.adapters.held(n) if self.adapters is not None else None for n in names}
        held = {n: self._params[n] if t is None and n in self._params else t for n, t in held.items()}
        sums, names = SumsOf(), [n for n, t in held.items() if t is not None]
        for name in names:
            sums.add(held[name])
        return {n: (v, held[n].dtype) for n, v in zip(names, sums.values(), strict=True)}

    def info(self) -> dict:
        lora = None if self.adapters is None else self.adapters.max_rank
        return {
            "torch_dtype": dtype_name(self.dtype),
            "device": str(self.device),
            "max_model_len": self.max_model_len,
            "max_lora_rank": lora,  # None: adapter-only syncs refused (--vllm_enable_lora false)
            "lora_versions": None if self.adapters is None else self.adapters.loaded,  # what weight_version may name
        }


class _Recorder:
    """Wraps the engine's logits-processor factory for one ``infer`` call and keeps the grammar processors it made,
    one per generate call in order, so that rows a grammar ended map back to their requests."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.made: list[GrammarLogitsProcessor] = []

    def __call__(self, config, prompt_width: int):
        procs = self.factory(config, prompt_width)
        self.made.extend(p for p in procs or () if isinstance(p, GrammarLogitsProcessor))
        return procs

    def failed_rows(self, n: int) -> dict[int, str]:
        """Request index → message for every request with a failed row (rows are requests × ``n``, in order)."""
        failed, offset = {}, 0
        for proc in self.made:
            for row, message in proc.failed.items():
                failed.setdefault((offset + row) // n, message)
            offset += proc.batch
        return failed


def model_context(model, limit: int | None) -> int:
    """The context a transformers model serves: its ``max_position_embeddings``, or ``limit`` when smaller."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is None and hasattr(model.config, "get_text_config"):  # a vision-language model's language model
        positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and positions is not None and limit > positions:
        raise ConfigError(
            f"--vllm_max_model_len {limit}: the model has {positions} positions "
            "(max_position_embeddings); use at most that"
        )
    if limit is None and positions is None:
        raise ConfigError("the model's config has no max_position_embeddings: give --vllm_max_model_len N")
    return limit if limit is not None else positions


__all__ = ["CANCEL", "ServedTransformersEngine", "context_message", "model_context"]
