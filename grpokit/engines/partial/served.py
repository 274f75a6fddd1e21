"""Partial rollouts for the served transformers engine (``--partial_rollouts true`` on the trainer).

A weight update that asks to interrupt (``UpdateWeightsBody.interrupt``) calls ``pause_for_update`` before it
takes the engine's lock: the rows generating now stop at their next token (a stopping criterion, in the fast
decode loop and HF ``generate`` alike), and the generate call hands the lock to the update while it waits. Once
the new weights are in (``resume_after_update``), the paused rows continue from their prompt plus the tokens they
have, with the tokens they have left, on the new weights: their finished tokens and logprobs are kept, and every
token carries the weight version that sampled it (``ChatCompletionResponseChoice.weight_versions``).

A continuation re-reads prompt + partial completion in one prefill, so it samples from exactly the distribution
an uninterrupted row would have on the new weights (repetition penalty, top-k/top-p and stop strings see the
whole sequence). Grammar-constrained rows cannot restart mid-grammar: the trainer refuses --partial_rollouts with
structured outputs.
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from grpokit.engines.partial.pause import PROBING, PauseGate
from grpokit.protocol import ChatCompletionResponseChoice, RequestConfig


class _Paused(StoppingCriteria):
    """Every row stops once the engine's pause is set (a weight update is waiting for the lock), unless the call
    cannot resume (a grammar-constrained one)."""

    def __init__(self, engine: PartialRollouts) -> None:
        self.engine = engine

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        stop = self.engine._pause.is_set() and self.engine._pausable
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class PartialRollouts(PauseGate):
    """Mixin for an engine with ``lock``, ``_generate(prompts, config, events)`` and ``_stopping(stop, events)``
    (TransformersEngine's)."""

    def _stopping(self, stop, events=None):
        criteria = super()._stopping(stop, events)
        return StoppingCriteriaList([*(criteria or []), _Paused(self)])

    def _generate(self, prompts: list[list[int]], config: RequestConfig, events: list | None = None, uniform=None):
        """Called with ``lock`` held; tags each token with the weight version; continues paused rows, a seeded
        call with the rest of its random stream (a pause that loads no weights, the sync check's, leaves its
        samples as they would have been, see ``_continue_seeded``); rows paused by an update that failed halfway
        stop where they are (the weights they would continue on are no version at all)."""
        version = self._sampled_version()
        pausable = not (config.structured_outputs_regex or config.structured_outputs_json or PROBING.get())
        seeded = config.seed is not None and config.temperature != 0
        self._pausable = pausable
        try:
            choices = super()._generate(prompts, config, events, uniform)
            stream = _rng_state(self.model) if seeded else None  # where the call's random stream stopped
        finally:
            self._pausable = True
        for c in choices:
            c.weight_versions = [version] * len(c.token_ids) if version is not None else None
        while pausable:
            paused = [i for i, c in enumerate(choices) if self._was_paused(c, config, events, i)]
            if not paused:
                return choices
            self._wait_for_update()
            if getattr(self, "weights_incomplete", False):
                return choices
            version = self._sampled_version(resumed=True)
            done = len(choices[paused[0]].token_ids)  # rows paused together have the same count of new tokens
            rest = config.model_copy(update={"max_tokens": config.max_tokens - done, "seed": None})
            rows = list(range(len(prompts))) if seeded else paused  # seeded: the whole batch draws again
            draws = None
            if seeded:
                draws = _seeded_draws(self.model, config, len(prompts), done, rows)
                _set_rng_state(self.model, stream)
            more = super()._generate(
                [prompts[i] + choices[i].token_ids for i in rows],
                rest,
                None if events is None else [events[i] for i in rows],
                draws,
            )
            stream = _rng_state(self.model) if seeded else None
            self.partial_resumes += len(paused)
            for i, m in zip(rows, more, strict=True):
                if i in paused:
                    choices[i] = self._joined(choices[i], m, version, config)
        return choices

    def _was_paused(self, c: ChatCompletionResponseChoice, config: RequestConfig, events, i: int) -> bool:
        """A row that stopped short without an end: the pause ended it (not a caller who left)."""
        if c.finish_reason != "length" or len(c.token_ids) >= config.max_tokens:
            return False
        return events is None or events[i] is None or not events[i].is_set()

    def _joined(
        self, first: ChatCompletionResponseChoice, more: ChatCompletionResponseChoice, version, config: RequestConfig
    ) -> ChatCompletionResponseChoice:
        ids = first.token_ids + more.token_ids
        lps = None
        if first.logprobs is not None and more.logprobs is not None:
            lps = [float(x["logprob"]) for x in first.logprobs["content"] + more.logprobs["content"]]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        joined = self._choice(ids, more.finish_reason, text, lps, config)
        versions = (first.weight_versions or []) + [version] * len(more.token_ids)
        joined.weight_versions = versions if first.weight_versions is not None and version is not None else None
        return joined


def _seeded_draws(model, config: RequestConfig, rows: int, done: int, kept: list[int]) -> torch.Tensor:
    """The rest of a seeded call's random stream on the fast decoder, for its rows ``kept``: it draws every token's
    uniform number up front from the seed (one per row and token), so the continuation samples token ``done`` on
    with the numbers the uninterrupted call would have used. (The global generator's state is left as it was.)"""
    device = next(model.parameters()).device
    saved = _rng_state(model)
    torch.manual_seed(config.seed)
    draws = torch.rand(config.max_tokens, rows, 1, device=device, dtype=torch.float64)
    _set_rng_state(model, saved)
    return draws[done:, kept]


def _rng_state(model) -> torch.Tensor:
    """The state of the generator HF ``generate`` samples with on the model's device.

    ``generate`` draws for every row of its batch at every step (finished rows too), so a continuation of the
    whole batch from this state samples the paused rows' next tokens exactly as the uninterrupted call would
    have: the HF-generate fallback keeps a seeded call's stream across a pause this way, whatever ran meanwhile
    (the sync check's probe samples too)."""
    device = next(model.parameters()).device
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(model, state: torch.Tensor) -> None:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
