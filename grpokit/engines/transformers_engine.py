"""Rollouts with Hugging Face ``generate`` on the live training weights (no copy): CPU-capable, no vLLM needed."""

from __future__ import annotations

import contextlib

import torch

from grpokit.engines.base import InferEngine
from grpokit.engines.prefix import cache_kwarg, prefill_shared_prompts, worth_sharing
from grpokit.engines.structured import StructuredOutputs
from grpokit.rollout.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    RequestConfig,
    RolloutInferRequest,
)
from grpokit.template.encode import ChatTemplate


class TransformersEngine(InferEngine):
    engine_type = "transformers"

    def __init__(self, model, template: ChatTemplate, max_batch_size: int = 256, unwrap=None) -> None:
        super().__init__()
        self.model = model
        self.template = template
        self.tokenizer = template.tokenizer
        self.max_batch_size = max_batch_size
        self._unwrap = unwrap or (lambda m: m)  # e.g. accelerator.unwrap_model
        self.share_prompts: bool | None = None  # prefill each distinct prompt once; None: when the model is big
        # enough for it to pay off (engines/prefix.py)
        # factory(config, prompt_width) -> LogitsProcessorList | None: structured outputs (engines/structured.py)
        self.logits_processor_factory = StructuredOutputs(self.tokenizer, template.eos_token_id,
                                                          template.pad_token_id)

    # ------------------------------------------------------------------------------------------------------
    def infer(self, requests: list[RolloutInferRequest], config: RequestConfig) -> list[ChatCompletionResponse]:
        if not requests:
            return []
        prompts = [self.template.encode_prompt(r.messages) for r in requests]  # memoised: a group renders once
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
        model = self._unwrap(self.model)
        device = next(model.parameters()).device
        pad = self.template.pad_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding
            input_ids[row, width - len(p):] = torch.tensor(p)
            attention[row, width - len(p):] = 1
        greedy = config.temperature == 0
        kwargs = dict(
            max_new_tokens=config.max_tokens,
            do_sample=not greedy,
            pad_token_id=pad,
            eos_token_id=self.template.eos_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            output_scores=config.logprobs,
            repetition_penalty=config.repetition_penalty,
        )
        if not greedy:
            kwargs.update(temperature=config.temperature, top_p=config.top_p,
                          top_k=config.top_k if config.top_k > 0 else None)
        else:  # silence generation_config sampling defaults in greedy mode
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if config.stop:
            kwargs.update(stop_strings=list(config.stop), tokenizer=self.tokenizer)
        if self.logits_processor_factory is not None:
            lp = self.logits_processor_factory(config, width)
            if lp is not None:
                kwargs["logits_processor"] = lp
        if config.seed is not None:
            torch.manual_seed(config.seed)
        was_training = model.training
        model.eval()
        try:
            with _no_gradient_checkpointing(model), _lora_merged(model):
                ids, att = input_ids.to(device), attention.to(device)
                share = worth_sharing(model) if self.share_prompts is None else self.share_prompts
                cache = prefill_shared_prompts(model, ids, att) if share else None
                if cache is not None:  # each distinct prompt was prefilled once; generate runs the last token on
                    kwargs[cache_kwarg(model)] = cache
                gen = model.generate(input_ids=ids, attention_mask=att, **kwargs)
        finally:
            model.train(was_training)
        new = gen.sequences[:, width:].cpu()
        logprobs = None
        if config.logprobs:
            scores = torch.stack(gen.scores, dim=1).float()  # [B, T, V] processed (temperature, top-k/p) logits
            logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1).to(scores.device)).squeeze(-1)
            logprobs = logprobs.cpu()
        return [self._choice(new[row], None if logprobs is None else logprobs[row], config)
                for row in range(new.shape[0])]

    def _choice(self, ids_T: torch.Tensor, lp_T: torch.Tensor | None, config: RequestConfig):
        ids = ids_T.tolist()
        eos, pad = self.template.eos_token_id, self.template.pad_token_id
        finish = "length"
        if eos in ids:
            ids = ids[: ids.index(eos) + 1]
            finish = "stop"
        elif pad != eos and pad in ids:  # finished early by a stop string; the rest is padding
            ids = ids[: ids.index(pad)]
            finish = "stop"
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if finish == "length" and config.stop and any(text.endswith(s) for s in config.stop):
            finish = "stop"
        lps = None
        if lp_T is not None:
            lps = {"content": [{"token_id": t, "logprob": float(v)} for t, v in zip(ids, lp_T[: len(ids)].tolist())]}
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
