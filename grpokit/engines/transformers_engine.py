"""Rollouts with Hugging Face ``generate`` on the live training weights (no copy): CPU-capable, no vLLM needed."""

from __future__ import annotations

import contextlib
import logging

import torch

from grpokit.engines.base import InferEngine
from grpokit.engines.fast_decode import FastDecoder, Unsupported, sampling_processors
from grpokit.engines.prefix import cache_kwarg, prefill_shared_prompts, worth_sharing
from grpokit.engines.structured import StructuredOutputs
from grpokit.rollout.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    RequestConfig,
    RolloutInferRequest,
)
from grpokit.template.encode import ChatTemplate
from grpokit.tensors import long_tensor

logger = logging.getLogger(__name__)


class TransformersEngine(InferEngine):
    engine_type = "transformers"

    def __init__(self, model, template: ChatTemplate, max_batch_size: int = 256) -> None:
        super().__init__()
        self.model = model
        self.template = template
        self.tokenizer = template.tokenizer
        self.max_batch_size = max_batch_size
        self.share_prompts: bool | None = None  # on HF generate: prefill each distinct prompt once; None: when the
        # model is big enough for it to pay off (engines/prefix.py). The fast loop always shares.
        # factory(config, prompt_width) -> LogitsProcessorList | None: structured outputs (engines/structured.py)
        self.logits_processor_factory = StructuredOutputs(self.tokenizer, template.eos_token_id,
                                                          template.pad_token_id)
        self.fast_decode = True  # grpokit's decode loop for Llama/Qwen2/Qwen3 models (engines/fast_decode.py)
        self._fallback_reasons: set[str] = set()
        self._stop_criteria: dict[tuple[str, ...], object] = {}

    # ------------------------------------------------------------------------------------------------------
    def infer(self, requests: list[RolloutInferRequest], config: RequestConfig) -> list[ChatCompletionResponse]:
        if not requests:
            return []
        prompts = self.template.encode_prompts([r.messages for r in requests])  # memoised: a group renders once
        flat = [p for p in prompts for _ in range(config.n)]
        choices: list[ChatCompletionResponseChoice] = []
        for start in range(0, len(flat), self.max_batch_size):
            choices.extend(self._generate(flat[start:start + self.max_batch_size], config))
        out = []
        for i, p in enumerate(prompts):
            group = choices[i * config.n:(i + 1) * config.n]
            for k, c in enumerate(group):
                c.index = k
            out.append(ChatCompletionResponse(choices=group, prompt_token_ids=p))
        return out

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], config: RequestConfig) -> list[ChatCompletionResponseChoice]:
        model = self.model  # the policy itself (the trainer passes it unwrapped from DDP/DeepSpeed)
        device = next(model.parameters()).device
        pad = self.template.pad_token_id
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        input_ids = long_tensor(t for p in prompts for t in [pad] * (width - len(p)) + p).view(len(prompts), width)
        attention = (torch.arange(width) >= width - long_tensor(lengths)[:, None]).long()  # left padding
        greedy = config.temperature == 0
        structured = self.logits_processor_factory(config, width) if self.logits_processor_factory else None
        stopping = self._stopping(config.stop)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        ids, att = input_ids.to(device), attention.to(device)
        fast = self._fast_decoder(model)  # reads LoRA updates itself: no merge, and no dropout, so the model's
        if fast is not None:  # train/eval mode and gradient checkpointing do not matter here
            procs = sampling_processors(greedy=greedy, temperature=config.temperature, top_k=config.top_k,
                                        top_p=config.top_p, repetition_penalty=config.repetition_penalty,
                                        extra=structured)
            new, logprobs = fast.generate(ids, att, config.max_tokens, eos_token_id=self.template.eos_token_id,
                                          pad_token_id=pad, greedy=greedy, processors=procs, stopping=stopping,
                                          want_logprobs=config.logprobs)
        else:
            with _no_gradient_checkpointing(model), _lora_merged(model):
                new, logprobs = self._hf_generate(model, ids, att, config, greedy, structured, stopping)
        rows = [self._trim(row) for row in new.tolist()]
        texts = self.tokenizer.batch_decode([ids for ids, _ in rows], skip_special_tokens=True)
        lps = [None] * len(rows) if logprobs is None else logprobs.float().cpu().tolist()
        return [self._choice(ids, finish, text, lp, config)
                for (ids, finish), text, lp in zip(rows, texts, lps, strict=True)]

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
        if structured is not None:
            kwargs["logits_processor"] = structured
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

    def _stopping(self, stop: list[str] | None):
        """HF's stop-string criterion for these strings (built once per set: building it scans the vocabulary)."""
        if not stop:
            return None
        key = tuple(stop)
        if key not in self._stop_criteria:
            from transformers import StoppingCriteriaList, StopStringCriteria

            self._stop_criteria[key] = StoppingCriteriaList([StopStringCriteria(self.tokenizer, list(stop))])
        return self._stop_criteria[key]

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
        return ChatCompletionResponseChoice(message={"role": "assistant", "content": text}, finish_reason=finish,
                                            token_ids=ids, logprobs=lps)


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
