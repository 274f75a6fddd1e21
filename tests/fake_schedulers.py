"""Multi-turn schedulers that tests register under their own names (``multi_turns[name] = ...``); importable as
``fake_schedulers`` from every test folder, like ``support``."""

from __future__ import annotations

from grpokit.rollout.multi_turn import MultiTurnScheduler

PREFILL = "<think>\nI plan.\n</think>\n\n"


class ThinkThenObserve(MultiTurnScheduler):
    """Every reply of turn 1 continues a prefilled <think> block; each later turn follows a user observation."""

    async def on_trajectory_start(self, requests):
        for r in requests:
            r.messages.append({"role": "assistant", "content": PREFILL})

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= self.max_turns

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": f"Observation {current_turn}"})
        return {"infer_request": infer_request}
