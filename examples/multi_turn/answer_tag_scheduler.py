"""Route 1 — implement ``step()`` and return token masks; keep the default turn loop.

``AnswerTagScheduler``: when a reply has no ``<answer>…</answer>``, the scheduler writes the opening of one
(``\\nFinal answer: <answer>``) into the SAME assistant message and lets the model finish it. The inserted tokens
get loss mask 0 (the model did not write them); everything the model wrote keeps mask 1 and its exact token ids.

As a plugin:
    grpokit train --external_plugins examples/multi_turn/answer_tag_scheduler.py \\
        --multi_turn_scheduler answer_tag --max_turns 2 --reward_funcs accuracy ...
Run directly (a tiny offline model, or --model DIR) to train two steps:
    python examples/multi_turn/answer_tag_scheduler.py
"""

from __future__ import annotations

from grpokit.rollout.builtin_schedulers import cut_token_prefix
from grpokit.rollout.multi_turn import MultiTurnScheduler, multi_turns

FORCED_PREFIX = "\nFinal answer: <answer>"


class AnswerTagScheduler(MultiTurnScheduler):
    def check_finished(self, infer_request, response_choice, current_turn) -> bool:
        text = infer_request.messages[-1]["content"]
        if "<answer>" in text and "</answer>" in text:
            return True  # well-formed: nothing to add
        return super().check_finished(infer_request, response_choice, current_turn)  # length / max_turns

    def step(self, infer_request, response_choice, current_turn) -> dict:
        text = response_choice.message["content"]
        ids = response_choice.token_ids
        keep = cut_token_prefix(self.tokenizer, ids, text, len(text))  # drops the trailing end-of-turn token
        kept_text = self.tokenizer.decode(ids[:keep], skip_special_tokens=True)
        inserted = self.encode_text(FORCED_PREFIX)
        # the request's last message is this turn's assistant reply: replace its text, the model continues it
        content = infer_request.messages[-1]["content"]
        earlier = content[: len(content) - len(text)]  # text of earlier turns when this turn continued it
        infer_request.messages[-1]["content"] = earlier + kept_text + FORCED_PREFIX
        logprobs = [lp["logprob"] for lp in (response_choice.logprobs or {}).get("content", [])][:keep]
        return {
            "infer_request": infer_request,
            "response_token_ids": list(ids[:keep]) + inserted,
            "response_loss_mask": [1] * keep + [0] * len(inserted),
            "rollout_logprobs": logprobs,  # one per mask-1 token
            "rollout_infos": {"forced_answer_tag": True},
        }


multi_turns["answer_tag"] = AnswerTagScheduler


def main() -> None:
    """Train two steps with this scheduler on a tiny offline model (or --model DIR)."""
    import argparse
    import json
    import tempfile
    from pathlib import Path

    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.testing import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model folder (default: a tiny random model)")
    parser.add_argument("--max_steps", default="2")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="grpokit_answer_tag_"))
    model = args.model or str(build_tiny_model(work / "model"))
    rows = [{"query": f"What is {a} + {b}?", "solution": str(a + b)} for a in range(1, 5) for b in range(1, 5)]
    (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_train_args(
        [
            "--model",
            model,
            "--dataset",
            str(work / "data.jsonl"),
            "--output_dir",
            str(work / "out"),
            "--multi_turn_scheduler",
            "answer_tag",
            "--max_turns",
            "2",
            "--reward_funcs",
            "accuracy",
            "--num_generations",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--max_completion_length",
            "32",
            "--max_steps",
            args.max_steps,
            "--beta",
            "0",
            "--plots",
            "false",
            "--save_final_model",
            "false",
        ]
    )
    run_train(cfg)


if __name__ == "__main__":
    main()
