"""Partial rollouts on vLLM (``--partial_rollouts true``): the rollout server's vLLM engine, and vLLM colocate.

``LLM.generate`` runs vLLM's engine until the whole batch has ended, so a weight update could only wait for it.
Here the batch is driven step by step through vLLM's public ``LLMEngine`` API (``add_request``, ``step``,
``abort_request``, with delta outputs) on the vLLM thread, and between two steps the loop looks at the pause
a waiting update sets (``PauseGate``). When it is set, the unfinished requests are aborted, each keeps the tokens
and logprobs it has, the lock goes to the update, and once the new weights are in each request is added again as
its prompt plus its tokens, with the tokens it has left: the continuation samples from the new weights (prefix
caching makes its prefill cheap), and every token carries the weight version that sampled it (with LoRA versions:
the one the call asked for, then after a pause the newest, each step naming that version's LoRARequest). The rollout
server's update pauses when the trainer asks it to (``interrupt``); in colocate mode the trainer's own sync does,
while the background producer of --max_staleness generates.

What cannot continue runs to its end as before: images (the continuation would need them re-attached),
structured outputs (a grammar cannot restart mid-completion; the trainer refuses the pair anyway) and requests with
several samples each. A stop string split across a pause is not seen, since the continuation's detokenizer starts
at the pause; its stop tokens are.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from grpokit.engines.partial.pause import PROBING, PauseGate
from grpokit.engines.vllm_engine import VllmEngine
from grpokit.protocol import ChatCompletionResponse, RequestConfig


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Piece:
    """One request's completion so far, in the shape ``VllmEngine._response`` reads from vLLM's outputs."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None  # per token {token id: _Logprob}, where asked for
    versions: list[int | None] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""


@dataclass
class _Output:
    prompt_token_ids: list[int]
    outputs: list[_Piece]


class VllmPartialRollouts(PauseGate):
    """Mixin for ``VllmEngine`` (``lock``, ``llm``, ``_run`` on the vLLM thread, ``_sample``, ``_response``)."""

    def _sample(self, inputs: list[dict], params: list) -> list:
        """Called with ``lock`` held: the batch's outputs, paused and continued across weight updates."""
        plain = PROBING.get() or any("multi_modal_data" in i for i in inputs)  # the probe runs on, paused or not
        if plain or any(p.n != 1 or p.structured_outputs for p in params):
            outs = super()._sample(inputs, params)
            version = self._sampling()[1]
            for out in outs:  # run to their end on the weights they began with
                for c in out.outputs:
                    c.versions = [version] * len(c.token_ids)
            return outs
        from vllm.sampling_params import RequestOutputKind  # not at the top: vLLM is imported only when served

        prompts = [list(i["prompt_token_ids"]) for i in inputs]
        pieces = [_Piece(logprobs=[] if p.logprobs is not None else None) for p in params]
        todo, resumed = list(range(len(inputs))), False
        while todo:
            steps = []
            for i in todo:
                p = params[i].clone()
                p.max_tokens = params[i].max_tokens - len(pieces[i].token_ids)
                p.output_kind = RequestOutputKind.DELTA  # each step's new tokens: kept when a pause aborts it
                steps.append((pieces[i], prompts[i] + pieces[i].token_ids, p))
            lora, version = self._sampling(resumed)  # after a pause: the newest version
            self._run(self._step_until_paused, steps, version, lora)
            todo = [i for i in todo if pieces[i].finish_reason is None]
            if todo:  # paused: the update loads the new weights, then these continue on them
                self.partial_resumes += sum(bool(pieces[i].token_ids) for i in todo)
                self._wait_for_update()
                resumed = True
        for piece in pieces:
            piece.text = self.tokenizer.decode(piece.token_ids, skip_special_tokens=True)
        return [_Output(prompt, [piece]) for prompt, piece in zip(prompts, pieces, strict=True)]

    def _step_until_paused(self, steps: list[tuple[_Piece, list[int], object]], version, lora=None) -> None:
        """On the vLLM thread: step the engine until every request has ended or the pause is set (those still
        open are then aborted), adding each step's new tokens to the request's piece, tagged ``version``;
        ``lora``: the LoRARequest sampled (None: the weights alone)."""
        engine = self.llm.llm_engine
        by_id = {}
        for piece, prompt, p in steps:
            request_id = f"grpokit-{uuid.uuid4().hex}"
            by_id[request_id] = piece
            engine.add_request(request_id, {"prompt_token_ids": prompt}, p, lora_request=lora)
        try:
            while engine.has_unfinished_requests() and not self._pause.is_set():
                for out in engine.step():
                    if out.request_id in by_id:
                        _extend(by_id[out.request_id], out, version)
        finally:
            still_open = [rid for rid, piece in by_id.items() if piece.finish_reason is None]
            if still_open:
                engine.abort_request(still_open)

    def _response(self, out, prompt_ids: list[int], config: RequestConfig) -> ChatCompletionResponse:
        """vLLM's answer, each choice tagged per token with the weight version that sampled it."""
        response = super()._response(out, prompt_ids, config)
        for choice, c in zip(response.choices, out.outputs, strict=True):
            versions = getattr(c, "versions", None)
            choice.weight_versions = versions if versions and None not in versions else None
        return response


class PausableVllmEngine(VllmPartialRollouts, VllmEngine):
    """vLLM colocate with --partial_rollouts true: the trainer's weight sync pauses the batch the background
    producer is generating, loads, and lets it continue. The trainer names the version before it syncs; tokens are
    tagged with it only once those weights are in (a batch starting in between still samples the old ones)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_partial()
        self._next_version: int | None = None

    def set_policy_version(self, version: int) -> None:
        self._next_version = version

    def sync_weights(self, model) -> None:
        self._paused(super().sync_weights, model)

    def sync_weights_checked(self, model):
        return self._paused(super().sync_weights_checked, model)

    def _paused(self, sync, model):
        self.pause_for_update()  # a batch generating in another thread hands over the lock at its next step
        try:
            result = sync(model)
            self.policy_version = self._next_version  # loaded: what the continuing rows are tagged with
            return result
        finally:
            self.resume_after_update()


def _extend(piece: _Piece, out, version) -> None:
    """A step's delta output added to ``piece``: its new tokens (tagged ``version``), logprobs, and the end."""
    c = out.outputs[0]
    new = list(c.token_ids)
    piece.token_ids += new
    piece.versions += [version] * len(new)
    if piece.logprobs is not None:
        piece.logprobs += [{t: _Logprob(float(pos[t].logprob))} for t, pos in zip(new, c.logprobs or [], strict=False)]
    if out.finished:
        piece.finish_reason = c.finish_reason
