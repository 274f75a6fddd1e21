"""Route 2 — override ``run()`` when the default turn loop does not fit.

``CriticReviseScheduler`` plays exactly two turns, whatever ``--max_turns`` says: the model answers; then the
SAME engine is asked, in a separate conversation that is never trained, to criticise that answer; the critique
goes back to the model as a user message and it writes its final answer. A side call like this is why ``run()``
is overridden: the default loop has one conversation per trajectory.

Building the output by hand: one token segment per assistant message after the prompt (the ids exactly as the
engine returned them), a loss mask of the same length, logprobs for the mask-1 tokens only. The critique is a
user message, so the chat template renders it between the two segments with loss mask 0.

As a plugin:
    grpokit train --external_plugins examples/multi_turn/critic_revise_run.py \\
        --multi_turn_scheduler critic_revise --reward_funcs accuracy ...
Run directly (a tiny offline model, or --model DIR) to train two steps:
    python examples/multi_turn/critic_revise_run.py
"""

from __future__ import annotations

from grpokit.protocol import RolloutInferRequest, RolloutOutput, choice_logprobs
from grpokit.rollout.multi_turn import MultiTurnScheduler, Trajectory, multi_turns


class CriticReviseScheduler(MultiTurnScheduler):
    critic_prompt = "Question: {question}\n\nAnswer: {answer}\n\nName one mistake in this answer, in one sentence."
    revise_prompt = "A reviewer says: {critique}\nGive your final answer."

    async def run(self, infer_request, request_config, **kwargs):
        await self.on_trajectory_start([infer_request])
        messages = [dict(m) for m in infer_request.messages]  # never edit the prompt the trainer encodes
        traj = Trajectory()

        first = await self.infer_engine.infer_async(
            infer_request.model_copy(update={"messages": messages}), request_config
        )
        answer = first.choices[0]
        messages.append({"role": "assistant", "content": answer.message["content"]})
        traj.add_turn(answer.token_ids, [1] * len(answer.token_ids), choice_logprobs(answer), continuation=False)

        question = next(m["content"] for m in reversed(infer_request.messages) if m["role"] == "user")
        critic = RolloutInferRequest(
            messages=[
                {
                    "role": "user",
                    "content": self.critic_prompt.format(question=question, answer=answer.message["content"]),
                }
            ]
        )
        critique = (await self.infer_engine.infer_async(critic, request_config)).choices[0].message["content"]

        messages.append({"role": "user", "content": self.revise_prompt.format(critique=critique.strip())})
        final = await self.infer_engine.infer_async(
            infer_request.model_copy(update={"messages": messages}), request_config
        )
        revised = final.choices[0]
        messages.append({"role": "assistant", "content": revised.message["content"]})
        traj.add_turn(revised.token_ids, [1] * len(revised.token_ids), choice_logprobs(revised), continuation=False)

        logprobs, _dropped = traj.checked_logprobs()
        return RolloutOutput(
            response=final,
            messages=messages,
            response_token_ids=traj.token_ids,
            response_loss_mask=traj.loss_mask,
            rollout_logprobs=logprobs,
            rollout_infos={"num_turns": 2, "critique": critique},
        )


multi_turns["critic_revise"] = CriticReviseScheduler


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
    work = Path(tempfile.mkdtemp(prefix="grpokit_critic_revise_"))
    model = args.model or str(build_tiny_model(work / "model"))
    rows = [{"query": f"What is {a} * {b}?", "solution": str(a * b)} for a in range(2, 6) for b in range(2, 6)]
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
            "critic_revise",
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
