"""Rollouts with Hugging Face ``generate`` on the live training weights (no copy): CPU-capable, no vLLM needed."""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict

import torch
from transformers import LogitsProcessorList, StoppingCriteria

from grpokit.engines.base import InferEngine
from grpokit.engines.fast_decode import FastDecoder, Unsupported
from grpokit.engines.grammar import StructuredOutputs
from grpokit.engines.mm_generate import infer_mm
from grpokit.engines.prefix import cache_kwarg, prefill_shared_prompts, worth_sharing
from grpokit.engines.sampling import FiniteLogitsCheck, sampling_processors
from grpokit.errors import ConfigError
from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RequestConfig, RolloutInferRequest
from grpokit.template.encode import ChatTemplate

logger = logging.getLogger(__name__)
STOP_CACHE_SIZE = 32  # stop-string criteria kept (each one scanned the vocabulary once)


class TransformersEngine(InferEngine):
    engine_type = "transformers"

    def __init__(
        self,
        model,
        template: ChatTemplate,
        max_batch_size: int = 256,
        *,
        fast_decode: bool = True,
        infer_on_loop_thread: bool = False,
        structured_outputs: bool = True,
    ) -> None:
        super().__init__(infer_on_loop_thread)
        self.model = model
        self.template = template
        self.tokenizer = template.tokenizer
        self.max_batch_size = max_batch_size
        self.share_prompts: bool | None = None  # on HF generate: prefill each distinct prompt once; None: when the
        # model is big enough for it to pay off (engines/prefix.py). The fast loop always shares.
        # factory(config, prompt_width) -> LogitsProcessorList | None: structured outputs (engines/structured.py);
        # None for an engine whose requests never carry a constraint (a trainer's, without --structured_outputs_*)
        factory = StructuredOutputs(self.tokenizer, template.eos_token_id, template.pad_token_id)
        self.logits_processor_factory = factory if structured_outputs else None
        self.fast_decode = fast_decode  # grpokit's decode loop for Llama/Qwen2/Qwen3 models (engines/fast_decode.py)
        self._fallback_reasons: set[str] = set()
        self._stop_criteria: OrderedDict[tuple[str, ...], object] = OrderedDict()
        self.max_model_len: int | None = None  # set (rollout server): prompt + max_tokens must fit, else ConfigError
        self.max_prefill_bytes: int | None = None  # set (rollout server): bounds one generate call's prefill
        self._max_token_chars: int | None = None

    # ------------------------------------------------------------------------------------------------------
    def infer(self, requests: list[RolloutInferRequest], config: RequestConfig) -> list[ChatCompletionResponse]:
        if not requests:
            return []
        if getattr(self.template, "multimodal", False):  # a vision-language model: HF generate with the images
            with _no_gradient_checkpointing(self.model), _lora_merged(self.model):
                return infer_mm(
                    self.model, self.template, requests, config, self.max_batch_size, self.logits_processor_factory
                )
        prompts = self._encode(requests, config.max_tokens)
        flat = [p for p in prompts for _ in range(config.n)]
        events = self.cancel_events(requests)
        flat_events = None if events is None else [e for e in events for _ in range(config.n)]
        choices: list[ChatCompletionResponseChoice] = []
        for stop in self._chunks(flat):
            choices.extend(self._generate(flat[stop], config, None if flat_events is None else flat_events[stop]))
        out = []
        for i, p in enumerate(prompts):
            group = choices[i * config.n : (i + 1) * config.n]
            for k, c in enumerate(group):
                c.index = k
            out.append(ChatCompletionResponse(choices=group, prompt_token_ids=p))
        return out

    def _chunks(self, flat: list[list[int]]):
        """Slices of rows for one generate call each: at most ``max_batch_size`` rows and, with
        ``max_prefill_bytes`` set, a prefill whose attention (distinct prompts × width² cells, each a float32
        score per head plus a mask byte, as CPU attention materialises them) fits in it. A row alone always runs."""
        if self.max_prefill_bytes is None:
            yield from (slice(i, i + self.max_batch_size) for i in range(0, len(flat), self.max_batch_size))
            return
        cell = 4 * getattr(self.model.config, "num_attention_heads", 1) + 1
        start = 0
        while start < len(flat):
            end, distinct, width = start, set(), 0
            while end < len(flat) and end - start < self.max_batch_size:
                key, new_width = tuple(flat[end]), max(width, len(flat[end]))
                count = len(distinct) + (key not in distinct)
                if end > start and count * new_width * new_width * cell > self.max_prefill_bytes:
                    break
                distinct.add(key)
                width, end = new_width, end + 1
            yield slice(start, end)
            start = end

    def cancel_events(self, requests: list[RolloutInferRequest]) -> list | None:
        """Per request, a ``threading.Event`` set when its caller gave up (its rows stop at the next token), or
        None. The rollout server's engine overrides this; here nothing is ever cancelled."""
        return None

    def _encode(self, requests: list[RolloutInferRequest], max_tokens: int) -> list[list[int]]:
        """Prompt ids (memoised: a group renders once); ConfigError when the template cannot render a request or,
        with ``max_model_len`` set, when a prompt plus ``max_tokens`` does not fit in it."""
        if self.max_model_len is not None:
            self._check_text_size(requests, max_tokens)
        try:
            prompts = self.template.encode_requests(requests)  # a later turn: the trajectory's own ids (pin_ids)
        except Exception as e:  # noqa: BLE001 - jinja2 and the template's own raise_exception: a bad conversation
            raise ConfigError(
                f"the chat template cannot render these messages: {type(e).__name__}: {str(e)[:200]}"
            ) from e
        if self.max_model_len is not None:
            for i, p in enumerate(prompts):
                if len(p) + max_tokens > self.max_model_len:
                    raise ConfigError(context_message(i, len(p), max_tokens, self.max_model_len))
        return prompts

    def _check_text_size(self, requests: list[RolloutInferRequest], max_tokens: int) -> None:
        """Refuse, before tokenizing, text too long to fit whatever the tokenization: no token spells more than
        ``_max_token_chars`` characters."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1
        budget = self.max_model_len * self._max_token_chars
        for i, r in enumerate(requests):
            chars = sum(len(m["content"]) for m in r.messages if isinstance(m.get("content"), str))
            if chars > budget:
                raise ConfigError(
                    context_message(i, f"at least {-(-chars // self._max_token_chars)}", max_tokens, self.max_model_len)
                )

    @torch.no_grad()
    def _generate(
        self, prompts: list[list[int]], config: RequestConfig, events: list | None = None, uniform=None
    ) -> list[ChatCompletionResponseChoice]:
        """``uniform``: the fast decoder's draws to sample with (a paused row's continuation: partial/served.py)."""
        if events is not None and all(e is not None and e.is_set() for e in events):
            return [self._choice([], "stop", "", None, config) for _ in prompts]  # every caller is gone
        model = self.model  # the policy itself (the trainer passes it unwrapped from DDP/DeepSpeed)
        device = next(model.parameters()).device
        pad = self.template.pad_token_id
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
        attention = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()  # left padding
        greedy = config.temperature == 0
        structured = self.logits_processor_factory(config, width) if self.logits_processor_factory else None
        stopping = self._stopping(config.stop, events)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        ids, att = input_ids.to(device), attention.to(device)
        fast = self._fast_decoder(model)  # reads LoRA updates itself: no merge, and no dropout, so the model's
        if fast is not None:  # train/eval mode and gradient checkpointing do not matter here
            procs = sampling_processors(
                greedy=greedy,
                temperature=config.temperature,
                top_k=config.top_k,
                top_p=config.top_p,
                repetition_penalty=config.repetition_penalty,
                extra=structured,
            )
            new, logprobs = fast.generate(
                ids,
                att,
                config.max_tokens,
                eos_token_id=self.template.eos_token_id,
                pad_token_id=pad,
                greedy=greedy,
                processors=procs,
                stopping=stopping,
                want_logprobs=config.logprobs,
                uniform=uniform,
            )
        else:
            with _no_gradient_checkpointing(model), _lora_merged(model):
                new, logprobs = self._hf_generate(model, ids, att, config, greedy, structured, stopping)
        rows = [self._trim(row) for row in new.tolist()]
        texts = self.tokenizer.batch_decode([ids for ids, _ in rows], skip_special_tokens=True)
        lps = [None] * len(rows) if logprobs is None else logprobs.float().cpu().tolist()
        return [
            self._choice(ids, finish, text, lp, config)
            for (ids, finish), text, lp in zip(rows, texts, lps, strict=True)
        ]

    def _hf_generate(self, model, ids, att, config: RequestConfig, greedy: bool, structured, stopping):
        """HF ``generate``: (new tokens [B, T], log-probabilities of them under the processed logits or None)."""
        width = ids.shape[1]
        kwargs = dict(
            max_new_tokens=config.max_tokens,
            do_sample=not greedy,
            pad_token_id=self.template.pad_token_id,
            eos_token_id=self.template.eos_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            output_scores=config.logprobs,
            repetition_penalty=config.repetition_penalty,
        )
        if not greedy:  # top-k off is 0 for HF generate (-1 or 0 in RequestConfig)
            kwargs.update(temperature=config.temperature, top_p=config.top_p, top_k=max(config.top_k, 0))
        else:  # silence generation_config sampling defaults in greedy mode
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if stopping is not None:
            kwargs["stopping_criteria"] = stopping
        kwargs["logits_processor"] = LogitsProcessorList([*(structured or []), FiniteLogitsCheck(width)])
        share = worth_sharing(model) if self.share_prompts is None else self.share_prompts
        cache = prefill_shared_prompts(model, ids, att) if share else None
        if cache is not None:  # each distinct prompt was prefilled once; generate runs the last token on
            kwargs[cache_kwarg(model)] = cache
        was_training = model.training
        model.eval()
        try:
            gen = model.generate(input_ids=ids, attention_mask=att, **kwargs)
        finally:
            model.train(was_training)
        new = gen.sequences[:, width:]
        if not config.logprobs:
            return new, None
        scores = torch.stack(gen.scores, dim=1).float()  # [B, T, V] processed (temperature, top-k/p) logits
        return new, torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)

    def _fast_decoder(self, model) -> FastDecoder | None:
        if not self.fast_decode:
            return None
        try:
            return FastDecoder(model)
        except Unsupported as e:
            if str(e) not in self._fallback_reasons:
                self._fallback_reasons.add(str(e))
                logger.info("transformers engine: sampling with HF generate, not grpokit's fast decode loop: %s", e)
            return None

    def _stopping(self, stop: list[str] | None, events: list | None = None):
        """HF's stop-string criterion for these strings (built once per set: building it scans the vocabulary),
        plus one that ends the rows whose caller gave up."""
        from transformers import StoppingCriteriaList

        criteria = []
        if stop:
            key = tuple(stop)
            if key not in self._stop_criteria:
                from transformers import StopStringCriteria

                self._stop_criteria[key] = StopStringCriteria(self.tokenizer, list(stop))
                while len(self._stop_criteria) > STOP_CACHE_SIZE:
                    self._stop_criteria.popitem(last=False)
            self._stop_criteria.move_to_end(key)
            criteria.append(self._stop_criteria[key])
        if events is not None and any(e is not None for e in events):
            criteria.append(_Cancelled(events))
        return StoppingCriteriaList(criteria) if criteria else None

    def _trim(self, ids: list[int]) -> tuple[list[int], str]:
        """A row's tokens up to its end (eos kept, padding dropped) and why it ended."""
        eos, pad = self.template.eos_token_id, self.template.pad_token_id
        if eos in ids:
            return ids[: ids.index(eos) + 1], "stop"
        if pad != eos and pad in ids:  # finished early by a stop string; the rest is padding
            return ids[: ids.index(pad)], "stop"
        return ids, "length"

    def _choice(self, ids: list[int], finish: str, text: str, lp: list[float] | None, config: RequestConfig):
        if finish == "length" and config.stop and any(text.endswith(s) for s in config.stop):
            finish = "stop"
        lps = None
        if lp is not None:
            lps = {"content": [{"token_id": t, "logprob": v} for t, v in zip(ids, lp)]}
        return ChatCompletionResponseChoice(
            message={"role": "assistant", "content": text}, finish_reason=finish, token_ids=ids, logprobs=lps
        )


def context_message(index: int, prompt_tokens, max_tokens: int, max_model_len: int) -> str:
    """The 400 answer for a request that does not fit in the context (vLLM's wording, both numbers named)."""
    total = f" = {prompt_tokens + max_tokens}" if isinstance(prompt_tokens, int) else ""
    return (
        f"request {index}: this model's maximum context length is {max_model_len} tokens, but the request "
        f"needs {prompt_tokens} prompt tokens + max_tokens {max_tokens}{total}; shorten the prompt or lower "
        "max_tokens"
    )


class _Cancelled(StoppingCriteria):
    """A stopping criterion: row i is done once ``events[i]`` is set (its HTTP client disconnected)."""

    def __init__(self, events: list) -> None:
        self.events = events

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        done = [e is not None and e.is_set() for e in self.events]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def _lora_merged(model):
    """Sample with LoRA adapters merged into the base weights: one matmul per layer instead of three (decode
    is dominated by per-call cost here: 20% faster rollouts on SmolLM2-135M, r=16 all-linear). Unmerged after, so
    training and the adapter-disabled reference see the same weights as before (to float rounding)."""
    merge = getattr(model, "merge_adapter", None)
    if merge is None or not getattr(model, "peft_config", None) or getattr(model, "merged", False):
        yield
        return
    merge()
    try:
        yield
    finally:
        model.unmerge_adapter()


@contextlib.contextmanager
def _no_gradient_checkpointing(model):
    """generate() needs the KV cache, which gradient checkpointing turns off; switch it off while sampling."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the HF model
    gc_on = getattr(base, "is_activation_checkpointing", None)
    if gc_on is None:  # transformers < 5
        gc_on = getattr(base, "is_gradient_checkpointing", False)
    if gc_on:
        model.gradient_checkpointing_disable()
    try:
        yield
    finally:
        if gc_on:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
