"""Token in, token out: the chat template's prefix audit, the text between turns under a template that drops
earlier <think> blocks, later turns sampled from the trajectory's own ids, and the trainer's violation count
(grpokit/template/prefix_audit.py, grpokit/rollout/tito.py)."""

from __future__ import annotations

import asyncio
import copy
import functools
import logging

import pytest
from test_multi_turn import tiny_tokenizer

from grpokit.engines.base import InferEngine
from grpokit.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
)
from grpokit.rollout.multi_turn import MultiTurnScheduler
from grpokit.rollout.tito import RECORD_KEY, digest, tito_metrics
from grpokit.template.encode import ChatTemplate
from grpokit.template.prefix_audit import audit_prefix
from grpokit.testing import THINK_DROPPING_TEMPLATE
from grpokit.trainers.batch import collate

THINK = "<think>\nplan it\n</think>\n\nAction: look"


@functools.lru_cache(maxsize=2)
def tokenizer(dropping: bool):
    """test_multi_turn's tiny tokenizer (built once), or a copy with the think-dropping template."""
    if not dropping:
        return tiny_tokenizer()
    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = THINK_DROPPING_TEMPLATE
    return tok


def test_prefix_audit_tells_a_preserving_template_from_one_that_drops_think():
    kept = audit_prefix(ChatTemplate(tokenizer(False)))
    assert kept.preserving is True and "is prefix-preserving, but" in kept.line(False)  # a client: said anyway
    audit = audit_prefix(ChatTemplate(tokenizer(True)))
    assert audit.preserving is False and 0 < audit.at < audit.short_len
    line = audit.line(True)
    assert "not prefix-preserving" in line and "drops earlier <think>" in line and "never from a re-render" in line
    assert "single-turn rollout server" in audit.line(False)


def test_prefix_audit_of_a_template_that_cannot_render_is_unknown():
    tok = copy.deepcopy(tokenizer(False))
    tok.chat_template = "{{ raise_exception('no assistant turns here') }}"
    audit = audit_prefix(ChatTemplate(tok))
    assert audit.preserving is None and audit.detail.startswith("ValueError")


def test_text_between_turns_under_a_dropping_template_is_the_template_s_own():
    # message 1's content is rendered without its <think> block once a user message follows, so the old rule
    # (the longer rendering starts with the shorter one + the content) cannot hold; the text after the content
    # is still what the template renders there
    template = ChatTemplate(tokenizer(True))
    full = [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": THINK},
        {"role": "user", "content": "Observation: ok"},
    ]
    seg = template.tokenize(THINK) + [template.eos_token_id]
    want = "\n<|im_start|>user\nObservation: ok<|im_end|>\n<|im_start|>assistant\n"
    assert template.between_text(full, 1, 3, seg) == want
    # a preserving template gives the same text by the old rule
    assert ChatTemplate(tokenizer(False)).between_text(full, 1, 3, seg) == template.between_text(full, 1, 3, seg)


class TemplateEngine(InferEngine):
    """Renders each request with its template (``encode_requests``: pinned ids for a later turn), as the real
    engines do, and replies ``THINK`` then ``reply 2``, ``reply 3``, ... one token per tokenizer token + eos."""

    def __init__(self, template: ChatTemplate) -> None:
        super().__init__()
        self.template, self.tokenizer = template, template.tokenizer
        self.prompts: list[list[int]] = []

    def infer(self, requests, config):
        out = []
        for r, prompt in zip(requests, self.template.encode_requests(requests), strict=True):
            n = sum(m["role"] == "assistant" for m in r.messages)
            text = THINK if n == 0 else f"reply {n + 1}"
            ids = self.template.tokenize(text) + [self.tokenizer.eos_token_id]
            self.prompts.append(prompt)
            out.append(
                ChatCompletionResponse(
                    prompt_token_ids=prompt,
                    choices=[
                        ChatCompletionResponseChoice(
                            message={"role": "assistant", "content": text}, finish_reason="stop", token_ids=ids
                        )
                    ],
                )
            )
        return out


class ObserveScheduler(MultiTurnScheduler):
    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": f"Observation: {current_turn}"})
        return {"infer_request": infer_request}


def _three_turns(dropping: bool, caplog=None):
    template = ChatTemplate(tokenizer(dropping))
    engine = TemplateEngine(template)
    req = RolloutInferRequest(messages=[{"role": "user", "content": "Go."}])
    out = asyncio.run(ObserveScheduler(engine, max_turns=3).run(req, RequestConfig(max_tokens=32)))
    out.request_id = req.request_id
    return template, engine, req, out


def _batch(template, sample):
    return collate([sample], template.pad_token_id, [False])


@pytest.mark.parametrize("dropping", [False, True])
def test_later_turns_are_sampled_from_the_trajectory_s_own_ids(dropping, caplog):
    caplog.set_level(logging.WARNING, logger="grpokit.rollout.multi_turn")
    template, engine, req, out = _three_turns(dropping)
    sample = template.encode_output(req.messages, out)
    full = sample.prompt_ids + sample.completion_ids
    assert len(engine.prompts) == 3 and len(out.rollout_infos[RECORD_KEY]) == 3
    for prompt in engine.prompts:  # every turn's prompt is the trained sequence so far
        assert full[: len(prompt)] == prompt
    assert template.tokenize(THINK) == sample.completion_ids[: len(template.tokenize(THINK))]  # trained as sampled
    rerender = template.encode_prompt(out.messages[:5])
    assert (rerender != engine.prompts[2]) is dropping  # a re-render would have lost turn 1's <think> block
    assert tito_metrics(_batch(template, sample), [out]) == {
        "multi_turn/tito_violations": 0.0,
        "multi_turn/tito_unchecked": 0.0,
    }
    said = [r.getMessage() for r in caplog.records if "prefix-preserving" in r.getMessage()]
    assert len(said) == int(dropping)  # once, and only for the template that drops


def _violations(template, sample, out) -> float:
    return tito_metrics(_batch(template, sample), [out])["multi_turn/tito_violations"]


def test_violation_counter_catches_trajectories_that_train_other_ids(caplog):
    template, _, req, out = _three_turns(True)
    good = template.encode_output(req.messages, out)
    assert _violations(template, good, out) == 0
    # turn 3 sampled after a re-render (the prompt the engine reports is not the trained prefix)
    record = copy.deepcopy(out.rollout_infos[RECORD_KEY])
    rerender = template.encode_prompt(out.messages[:5])
    record[2][:2] = [len(rerender), digest(rerender)]
    bad = out.model_copy(update={"rollout_infos": {**out.rollout_infos, RECORD_KEY: record}})
    caplog.set_level(logging.WARNING, logger="grpokit.rollout.tito")
    assert _violations(template, good, bad) == 1
    assert "turn 3 was sampled from" in caplog.text and "not the" in caplog.text
    # an inserted (template) token marked as trained
    wrong = copy.deepcopy(good)
    first_gap = len(out.response_token_ids[0])
    wrong.completion_mask[first_gap] = 1
    assert _violations(template, wrong, out) == 1
    # a sampled token replaced in the trained ids
    edited = copy.deepcopy(good)
    edited.completion_ids[0] = (edited.completion_ids[0] + 1) % len(template.tokenizer)
    assert _violations(template, edited, out) == 1
    # ids appended after the last turn's sampled ones
    longer = copy.deepcopy(good)
    longer.completion_ids.append(template.eos_token_id)
    longer.completion_mask.append(0)
    assert _violations(template, longer, out) == 1
    # a malformed record (a rollout server of another version) is a violation, not a crash
    junk = out.model_copy(update={"rollout_infos": {RECORD_KEY: [["x"]]}})
    assert _violations(template, good, junk) == 1
    # no record (a run() override): unchecked
    none = out.model_copy(update={"rollout_infos": {}})
    assert tito_metrics(_batch(template, good), [none]) == {
        "multi_turn/tito_violations": 0.0,
        "multi_turn/tito_unchecked": 1.0,
    }


def test_a_row_cut_to_the_completion_limit_is_checked_up_to_the_cut():
    template, _, req, out = _three_turns(True)
    sample = template.encode_output(req.messages, out)
    cut = collate([sample], template.pad_token_id, [True], max_completion_length=len(out.response_token_ids[0]) + 3)
    assert tito_metrics(cut, [out])["multi_turn/tito_violations"] == 0


def test_a_step_that_rewrites_sampled_tokens_keeps_only_their_common_prefix_as_sampled():
    template = ChatTemplate(tokenizer(False))

    class Rewrite(ObserveScheduler):
        def step(self, infer_request, response_choice, current_turn):
            result = super().step(infer_request, response_choice, current_turn)
            ids = list(response_choice.token_ids)
            ids[1] = ids[0]  # a token the engine did not sample, still marked trained
            return {**result, "response_token_ids": ids, "response_loss_mask": [1] * len(ids)}

    req = RolloutInferRequest(messages=[{"role": "user", "content": "Go."}])
    out = asyncio.run(Rewrite(TemplateEngine(template), max_turns=2).run(req, RequestConfig(max_tokens=32)))
    out.request_id = req.request_id
    assert out.rollout_infos[RECORD_KEY][0][2] == 1  # one sampled token kept
    sample = template.encode_output(req.messages, out)
    assert _violations(template, sample, out) == 1


def test_rollout_output_record_is_json():
    _, _, _, out = _three_turns(False)
    again = RolloutOutput.model_validate_json(out.model_dump_json())
    assert again.rollout_infos[RECORD_KEY] == out.rollout_infos[RECORD_KEY]
