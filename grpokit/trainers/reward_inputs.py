"""What reward functions receive for a batch of trajectories: the completions and ms-swift's keyword arguments
(the dataset's columns, messages, token ids, trajectory inputs, trainer state ...)."""

from __future__ import annotations

from typing import Any

from grpokit.protocol import RolloutInferRequest, RolloutOutput
from grpokit.rewards.calling import as_trainer_state, swift_kwargs
from grpokit.trainers.window import trajectory_images


def reward_inputs(
    requests: list[RolloutInferRequest], outputs: list[RolloutOutput], trainer_state: Any, *, images: bool
) -> tuple[list[str], dict[str, Any]]:
    """The completions (each trajectory's last assistant message) and the reward functions' keyword arguments;
    ``images``: whether trajectories may carry images (decided once per run)."""
    by_id = {r.request_id: r for r in requests}
    completions = [
        o.messages[-1]["content"]
        if o.messages and o.messages[-1]["role"] == "assistant"
        else o.response.choices[0].message["content"]
        for o in outputs
    ]
    kwargs: dict[str, Any] = {}
    for col in {k for r in requests for k in r.data_dict}:
        kwargs[col] = [by_id[o.request_id].data_dict.get(col) for o in outputs]
    # the row's images, then later turns'
    imgs_of = [trajectory_images(o, by_id) if images else [] for o in outputs]
    if any(imgs_of):  # as ms-swift: a trajectory's images replace the row's column
        kwargs["images"] = imgs_of
    token_ids = [[t for seg in o.response_token_ids for t in seg] for o in outputs]
    trajectories: dict[str, list[dict]] = {}  # ms-swift's trajectory_inputs: every output (round) of a request
    for o, imgs in zip(outputs, imgs_of):
        row = swift_kwargs(by_id[o.request_id].data_dict)  # the dataset columns, no hidden ones
        trajectories.setdefault(o.request_id, []).append(
            {**row, **({"images": imgs} if imgs else {}), "messages": o.messages, "rollout_infos": o.rollout_infos}
        )
    kwargs.update(
        messages=[o.messages for o in outputs],
        response_token_ids=token_ids,
        completion_ids=token_ids,
        rollout_infos=[o.rollout_infos for o in outputs],
        finish_reason=[o.response.choices[0].finish_reason for o in outputs],
        is_truncated=[o.response.choices[0].finish_reason == "length" for o in outputs],
        num_turns=[o.rollout_infos.get("num_turns", 1) for o in outputs],
        trainer_state=as_trainer_state(trainer_state),
        prompts=[o.prompt_messages or by_id[o.request_id].messages for o in outputs],
        request_id=[o.request_id for o in outputs],
        trajectory_inputs=trajectories,
    )
    return completions, kwargs
