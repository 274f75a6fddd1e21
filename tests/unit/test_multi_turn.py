"""MultiTurnScheduler's default loop with a scripted engine: token bookkeeping, masks, limits, errors.

``ScriptedEngine`` replies with canned text turned into ONE TOKEN PER CHARACTER (plus eos). A tokenizer would
merge those characters into fewer tokens, so any re-encoding of a completion would show up as a mismatch.
The other test_multi_turn_*.py files import the helpers from here.
"""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Callable

import pytest

from grpokit.engines.base import InferEngine
from grpokit.errors import ConfigError, RolloutError
from grpokit.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
)
from grpokit.rollout.multi_turn import MultiTurnScheduler, build_scheduler, multi_turns
from grpokit.rollout.scheduler import run_trajectories
from grpokit.template.encode import ChatTemplate


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    from grpokit.testing import build_tiny_tokenizer

    return build_tiny_tokenizer()


def char_ids(tok, text: str) -> list[int]:
    """One token per character (each is a single byte-level token for ASCII)."""
    ids = [tok(c, add_special_tokens=False)["input_ids"] for c in text]
    assert all(len(i) == 1 for i in ids), text
    return [i[0] for i in ids]


class ScriptedEngine(InferEngine):
    """``reply(request) -> text``; token ids = one per character + eos, cut to max_tokens ('length')."""

    def __init__(self, tokenizer, reply: Callable[[RolloutInferRequest], str]) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.reply = reply
        self.calls: list[tuple[list[dict], RequestConfig]] = []
        self.produced: list[list[int]] = []
        self.batch_sizes: list[int] = []

    def infer(self, requests, config):
        self.batch_sizes.append(len(requests))
        out = []
        for r in requests:
            cfg = r.request_config or config
            self.calls.append((copy.deepcopy(r.messages), cfg))
            ids = char_ids(self.tokenizer, self.reply(r)) + [self.tokenizer.eos_token_id]
            finish = "stop"
            if len(ids) > cfg.max_tokens:
                ids, finish = ids[: cfg.max_tokens], "length"
            lps = None
            if cfg.logprobs:  # token k of this reply gets logprob -(k+1)/100
                lps = {"content": [{"token_id": t, "logprob": -(k + 1) / 100} for k, t in enumerate(ids)]}
            self.produced.append(ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append(
                ChatCompletionResponse(
                    choices=[
                        ChatCompletionResponseChoice(
                            message={"role": "assistant", "content": text},
                            finish_reason=finish,
                            token_ids=ids,
                            logprobs=lps,
                        )
                    ]
                )
            )
        return out


def request(text: str = "Go.", **data) -> RolloutInferRequest:
    return RolloutInferRequest(messages=[{"role": "user", "content": text}], data_dict=data)


def run_one(scheduler, req: RolloutInferRequest, **cfg) -> RolloutOutput | list[RolloutOutput]:
    return asyncio.run(scheduler.run(req, RequestConfig(**cfg)))


def encode(out: RolloutOutput, prompt: list[dict]):
    return ChatTemplate(tiny_tokenizer()).encode_output(prompt, out)


def n_assistant(req: RolloutInferRequest) -> int:
    return sum(m["role"] == "assistant" for m in req.messages)


class EchoScheduler(MultiTurnScheduler):
    """Never finishes by itself; each step appends a user 'more' message."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "more"})
        return {"infer_request": infer_request}


# ----------------------------------------------------------------------------------------------------------------
def test_max_turns_is_enforced_even_when_check_finished_never_stops():
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, lambda r: f"reply {n_assistant(r)}")
    out = run_one(EchoScheduler(engine, max_turns=2, tokenizer=tok), request())
    assert len(engine.calls) == 2
    assert out.rollout_infos["num_turns"] == 2 and out.rollout_infos["stop_reason"] == "max_turns"
    # prompt, reply 0, more, reply 1: one segment per assistant message, each exactly as produced
    assert [m["role"] for m in out.messages] == ["user", "assistant", "user", "assistant"]
    assert out.response_token_ids == engine.produced
    assert out.response_loss_mask == [[1] * len(s) for s in engine.produced]


def test_default_max_turns_and_validation():
    assert MultiTurnScheduler().max_turns == 3
    with pytest.raises(ConfigError, match="--max_turns 0"):
        MultiTurnScheduler(max_turns=0)


def test_trainer_prompt_request_is_not_mutated():
    tok = tiny_tokenizer()
    req = request()
    run_one(EchoScheduler(ScriptedEngine(tok, lambda r: "x"), max_turns=3, tokenizer=tok), req)
    assert req.messages == [{"role": "user", "content": "Go."}]


def test_on_turn_end_done_overrides_and_infos_merge():
    class Hooked(EchoScheduler):
        async def on_turn_end(self, infer_request, response_choice, current_turn):
            return {"done": current_turn == 2, "rollout_infos": {"seen": current_turn}}

    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, lambda r: "hi")
    out = run_one(Hooked(engine, max_turns=5, tokenizer=tok), request())
    assert len(engine.calls) == 2
    assert out.rollout_infos["seen"] == 2 and out.rollout_infos["stop_reason"] == "done"


def test_default_check_finished_stops_on_length():
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, lambda r: "a long reply that will not fit")
    out = run_one(_LengthOnly(engine, tokenizer=tok), request(), max_tokens=5)
    assert len(engine.calls) == 1 and out.response.choices[0].finish_reason == "length"
    assert out.response_token_ids == [engine.produced[0]] and len(engine.produced[0]) == 5


class _LengthOnly(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "again"})
        return {"infer_request": infer_request}


def test_continuation_extends_the_segment_and_text_between_turns_is_masked():
    class Continue(MultiTurnScheduler):
        """Turn 1 is continued (same assistant message); turn 2 is followed by a user message."""

        def step(self, infer_request, response_choice, current_turn):
            if current_turn == 2:
                infer_request.messages.append({"role": "user", "content": "Observation: 42"})
            return {"infer_request": infer_request}

    tok = tiny_tokenizer()
    replies = iter(["First part", " and more", "Done."])
    engine = ScriptedEngine(tok, lambda r: next(replies))
    out = run_one(Continue(engine, max_turns=3, tokenizer=tok), request())
    p1, p2, p3 = engine.produced
    # turn 1 ends with eos; the engine continued the message, so the eos stays inside the segment as produced
    assert out.response_token_ids == [p1 + p2, p3]
    assert out.messages[1] == {"role": "assistant", "content": "First part and more"}
    assert engine.calls[1][0][-1] == {"role": "assistant", "content": "First part"}  # turn 2 continued it
    enc = encode(out, request().messages)
    gap = tok("\n<|im_start|>user\nObservation: 42<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
        "input_ids"
    ]
    assert enc.completion_ids == p1 + p2 + gap + p3
    assert enc.completion_mask == [1] * len(p1 + p2) + [0] * len(gap) + [1] * len(p3)


# -- step() validation ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ret, match",
    [
        ({"response_token_ids": [1, 2]}, "without 'infer_request'"),
        (None, "without 'infer_request'"),
        ("REQ+ids", "without response_loss_mask"),
        ("REQ+ids+short_mask", "response_loss_mask has 1 entries for 2"),
        ("REQ+bad_mask", "only 0 and 1"),
    ],
)
def test_step_contract_errors_name_the_scheduler_and_turn(ret, match):
    class Broken(MultiTurnScheduler):
        def step(self, infer_request, response_choice, current_turn):
            if ret == "REQ+ids":
                return {"infer_request": infer_request, "response_token_ids": [1, 2]}
            if ret == "REQ+ids+short_mask":
                return {"infer_request": infer_request, "response_token_ids": [1, 2], "response_loss_mask": [1]}
            if ret == "REQ+bad_mask":
                return {"infer_request": infer_request, "response_token_ids": [1, 2], "response_loss_mask": [1, 2]}
            return ret

    tok = tiny_tokenizer()
    with pytest.raises(RolloutError, match=match) as e:
        run_one(Broken(ScriptedEngine(tok, lambda r: "x"), max_turns=3, tokenizer=tok), request())
    assert "Broken.step() at turn 1" in str(e.value)


def test_step_not_implemented_says_what_to_do():
    tok = tiny_tokenizer()
    with pytest.raises(NotImplementedError, match="must implement step"):
        run_one(MultiTurnScheduler(ScriptedEngine(tok, lambda r: "x"), max_turns=2), request())


# -- logprobs ------------------------------------------------------------------------------------------------------
def test_logprobs_follow_the_trained_tokens_and_mismatch_is_dropped():
    class Inserting(MultiTurnScheduler):
        """Turn 1: keep the first 2 model tokens, insert 3 tokens with mask 0, continue the message."""

        bad = False

        def step(self, infer_request, response_choice, current_turn):
            ids = response_choice.token_ids[:2] + [5, 6, 7]
            lps = [-0.01, -0.02] + ([-9.0] if self.bad else [])
            return {
                "infer_request": infer_request,
                "response_token_ids": ids,
                "response_loss_mask": [1, 1, 0, 0, 0],
                "rollout_logprobs": lps,
            }

    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, lambda r: "abc")
    out = run_one(Inserting(engine, max_turns=2, tokenizer=tok), request(), logprobs=True)
    p1, p2 = engine.produced
    assert out.response_token_ids == [p1[:2] + [5, 6, 7] + p2]
    # 2 kept tokens of turn 1, then turn 2's 4 tokens (abc + eos) with logprobs -0.01..-0.04
    assert out.rollout_logprobs == [[-0.01, -0.02, -0.01, -0.02, -0.03, -0.04]]
    assert "logprobs_dropped" not in out.rollout_infos

    bad = Inserting(ScriptedEngine(tok, lambda r: "abc"), max_turns=2, tokenizer=tok)
    bad.bad = True  # 3 logprobs for 2 trained tokens
    out = run_one(bad, request(), logprobs=True)
    assert out.rollout_logprobs == [] and out.rollout_infos["logprobs_dropped"] == 1


def test_loss_scale_last_round_trains_only_the_last_assistant_message():
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, lambda r: "ok")
    out = run_one(EchoScheduler(engine, max_turns=3, tokenizer=tok, loss_scale="last_round"), request(), logprobs=True)
    assert out.response_loss_mask == [[0] * 3, [0] * 3, [1] * 3]
    assert out.rollout_logprobs == [[], [], [-0.01, -0.02, -0.03]]


# -- completion_length_limit_scope ---------------------------------------------------------------------------------
def _gap_len(tok, text: str) -> int:
    return len(
        tok(f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    )


def test_total_scope_gives_each_turn_what_is_left():
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, lambda r: "0123456789")  # 10 chars + eos = 11 tokens per turn
    out = run_one(
        EchoScheduler(engine, max_turns=3, tokenizer=tok, completion_length_limit_scope="total"),
        request(),
        max_tokens=60,
    )
    gap = _gap_len(tok, "more")
    # turn 1: 60; turn 2: 60 - 11 - gap; turn 3: 60 - 2 * (11 + gap)
    assert [c.max_tokens for _, c in engine.calls] == [60, 60 - 11 - gap, 60 - 2 * (11 + gap)]
    assert len(encode(out, request().messages).completion_ids) <= 60


def test_total_scope_stops_when_the_budget_is_spent():
    tok = tiny_tokenizer()
    gap = _gap_len(tok, "more")
    engine = ScriptedEngine(tok, lambda r: "0123456789")
    budget = 11 + gap  # turn 1 plus the user message fill it exactly: no room for turn 2
    out = run_one(
        EchoScheduler(engine, max_turns=3, tokenizer=tok, completion_length_limit_scope="total"),
        request(),
        max_tokens=budget,
    )
    assert len(engine.calls) == 1
    assert out.rollout_infos["stop_reason"] == "length_budget"
    assert out.response.choices[0].finish_reason == "length"  # the trajectory was cut, not finished
    assert [m["role"] for m in out.messages] == ["user", "assistant"]  # ends as the model left it


def test_per_round_scope_gives_every_turn_the_full_limit():
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, lambda r: "0123456789")
    run_one(EchoScheduler(engine, max_turns=3, tokenizer=tok), request(), max_tokens=20)
    assert [c.max_tokens for _, c in engine.calls] == [20, 20, 20]


# -- run() override, concurrency, registry -------------------------------------------------------------------------
def test_custom_run_returning_several_outputs_is_used_by_run_trajectories():
    class TwoDrafts(MultiTurnScheduler):
        async def run(self, infer_request, request_config, **kwargs):
            outs = []
            for _ in range(2):
                resp = await self.infer_engine.infer_async(infer_request, request_config)
                c = resp.choices[0]
                outs.append(
                    RolloutOutput(
                        response=resp,
                        messages=[*infer_request.messages, c.message],
                        response_token_ids=[c.token_ids],
                        response_loss_mask=[[1] * len(c.token_ids)],
                    )
                )
            return outs

    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, lambda r: "draft")
    reqs = [request(f"q{i}") for i in range(3)]
    outs = run_trajectories(TwoDrafts(engine, tokenizer=tok), reqs, RequestConfig())
    assert len(outs) == 6
    assert [o.request_id for o in outs] == [r.request_id for r in reqs for _ in range(2)]
    assert max(engine.batch_sizes) == 3  # the three trajectories' turns were batched into one engine call


def test_concurrent_trajectories_are_batched_per_turn():
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, lambda r: "x")
    reqs = [request(f"q{i}") for i in range(4)]
    outs = run_trajectories(EchoScheduler(engine, max_turns=3, tokenizer=tok), reqs, RequestConfig())
    assert engine.batch_sizes == [4, 4, 4]
    assert all(o.rollout_infos["num_turns"] == 3 for o in outs)


def test_build_scheduler_looks_up_the_registry():
    from grpokit.config.args import RolloutArguments

    tok = tiny_tokenizer()
    args = RolloutArguments(
        multi_turn_scheduler="tool_call_scheduler", max_turns=4, completion_length_limit_scope="total"
    )
    s = build_scheduler(args, tok)
    assert type(s) is multi_turns["tool_call_scheduler"]
    assert s.infer_engine is None and s.max_turns == 4 and s.tokenizer is tok
    assert s.completion_length_limit_scope == "total"
    with pytest.raises(ConfigError, match=r"--multi_turn_scheduler 'nope'.*math_tip_trick.*tool_call_scheduler"):
        build_scheduler(RolloutArguments(multi_turn_scheduler="nope"), tok)
