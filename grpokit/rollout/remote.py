"""Server mode's scheduler on the trainer side: every trajectory (single- or multi-turn) runs on the rollout
servers, which hold their own schedulers; the trainer still only asks a scheduler for trajectories.

ms-swift takes the multi-turn options (``--multi_turn_scheduler``, ``--max_turns``, ``--loss_scale``, ...) on the
trainer's command as well as the server's. Here the server plays the trajectories, so the trainer's values are
checked against what the server reports on ``/get_engine_type/`` (``check_server_rollout``): a value the server
does not use stops the run at start-up, naming the server's value and the fix. A trainer that names a
``--multi_turn_scheduler`` while the server is single-turn plays the turns itself, each turn one request to the
server (ms-swift does the same; ``trainer_plays_turns``). ``--loss_scale last_round`` is the
exception: as in ms-swift it shapes what the trainer trains on, so the trainer applies it to every trajectory it
receives (``last_round_only``), whatever the server's scheduler did.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from grpokit.data.images import row_images
from grpokit.engines.client import RolloutClient
from grpokit.errors import ConfigError, RolloutError
from grpokit.protocol import RequestConfig, RolloutInferRequest, RolloutOutput
from grpokit.rollout.scheduler import RolloutScheduler
from grpokit.template.prefix_audit import audit_prefix

logger = logging.getLogger(__name__)
MEDIA_KEYS = ("images", "videos", "audios")  # prompt media in data_dict: sent whatever --vllm_server_pass_dataset


class RemoteScheduler(RolloutScheduler):
    """The trainer's scheduler in server mode: every trajectory (single- or multi-turn) runs on the servers.

    ``pass_dataset``: send each row's extra columns (``data_dict``) to the servers; otherwise only the messages
    travel (ms-swift's ``--vllm_server_pass_dataset``; the trainer's rewards read the columns either way).
    ``use_gym_env``: an explicit choice whether the server's ``total_reward`` is a reward (None: the server says).
    ``loss_scale``: ``last_round`` trains only the last round of each trajectory that comes back.
    ``template``: the trainer's; for a vision-language model, each image prompt's ids as the server sampled from
    them must be the ids the trainer's processor gives (``check_prompt_ids``), since the trainer trains on those.
    """

    def __init__(
        self,
        client: RolloutClient,
        pass_dataset: bool = True,
        use_gym_env: bool | None = None,
        loss_scale: str = "default",
        template=None,
        **kwargs,
    ) -> None:
        super().__init__(infer_engine=client, **kwargs)
        self.pass_dataset = pass_dataset
        self.use_gym_env = use_gym_env
        self.loss_scale = loss_scale
        self.template = template

    @classmethod
    def from_args(cls, client: RolloutClient, rollout_args, template=None) -> RemoteScheduler:
        """From ``RolloutArguments``, after checking them against the server's configuration."""
        info = client.engine_info()
        check_server_rollout(rollout_args, info)
        pass_dataset = bool(rollout_args.vllm_server_pass_dataset or rollout_args.multi_turn_scheduler)
        if info.get("enable_multi_turn") and not pass_dataset:
            logger.warning(
                "the rollout server runs %s; the rows' columns are not sent to it (ms-swift's default): "
                "add --vllm_server_pass_dataset true if its scheduler or environment reads them",
                info.get("multi_turn_scheduler"),
            )
        if info.get("enable_multi_turn") and template is not None:  # the trainer renders the text between turns
            audit = audit_prefix(template)
            if audit.preserving is False:  # the server samples later turns from the trajectory's ids (pin_ids)
                logger.warning("%s", audit.line(True))
        return cls(
            client,
            pass_dataset=pass_dataset,
            use_gym_env=rollout_args.use_gym_env,
            loss_scale=rollout_args.loss_scale,
            template=template,
        )

    @property
    def multi_turn(self) -> bool:  # the server's scheduler plays the turns: the trainer audits them (rollout/tito.py)
        info = getattr(self.infer_engine, "engine_info", None)
        return bool(info().get("enable_multi_turn")) if callable(info) else False

    @property
    def uses_env_reward(self) -> bool:  # the server's scheduler decides (e.g. gym_scheduler) unless told
        if self.use_gym_env is not None:
            return self.use_gym_env
        return bool(self.infer_engine.engine_info().get("uses_env_reward", False))

    def _wire(self, requests: Sequence[RolloutInferRequest]) -> list[RolloutInferRequest]:
        """The requests as sent: without the row's columns unless asked, keeping its media (part of the prompt
        itself, as ms-swift's requests carry images apart from the dataset's columns)."""
        if self.pass_dataset:
            return list(requests)
        return [
            r.model_copy(update={"data_dict": {k: v for k, v in r.data_dict.items() if k in MEDIA_KEYS}})
            if r.data_dict
            else r
            for r in requests
        ]

    def _trained(self, requests: Sequence[RolloutInferRequest], outputs: list[RolloutOutput]) -> list[RolloutOutput]:
        if getattr(self.template, "multimodal", False):
            check_prompt_ids(self.template, requests, outputs)
        return [last_round_only(o) for o in outputs] if self.loss_scale == "last_round" else outputs

    async def run(
        self, infer_request: RolloutInferRequest, request_config: RequestConfig, **kwargs
    ) -> list[RolloutOutput]:
        return self._trained(
            [infer_request],
            await self.infer_engine.infer_trajectories_async(self._wire([infer_request]), request_config),
        )

    async def async_infer(
        self, requests: Sequence[RolloutInferRequest], request_config: RequestConfig, server: int | None = None
    ) -> list[RolloutOutput]:
        """Trajectories from the servers (all from server number ``server`` where given: a --stream_groups
        producer's own server)."""
        infer, wire = self.infer_engine.infer_trajectories_async, self._wire(requests)
        outputs = await (infer(wire, request_config) if server is None else infer(wire, request_config, server=server))
        return self._trained(requests, outputs)

    @property
    def num_servers(self) -> int:
        """How many rollout servers answer: with --stream_groups each gets a producer of its own."""
        return len(getattr(self.infer_engine, "endpoints", ())) or 1


def check_prompt_ids(template, requests: Sequence[RolloutInferRequest], outputs: list[RolloutOutput]) -> None:
    """RolloutError unless the prompt ids a server sampled each single-turn image trajectory from are the ids
    the trainer's processor gives its prompt and images (memoised: the trainer's encoding reuses them)."""
    by_id = {r.request_id: r for r in requests}
    for o in outputs:
        r = by_id.get(o.request_id)
        got = o.response.prompt_token_ids
        if r is None or got is None or len(o.response_token_ids) != 1 or not row_images(r.data_dict):
            continue
        want, _ = template.encode_mm(o.prompt_messages or r.messages, row_images(r.data_dict))
        if list(got) != want:
            at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise RolloutError(
                f"request {o.request_id}: the rollout server's prompt ids differ from this trainer's "
                f"processor's ({len(got)} vs {len(want)} ids, first difference at position {at}); "
                "serve the trainer's model folder (same processor and chat template)"
            )


def last_round_only(output: RolloutOutput) -> RolloutOutput:
    """``--loss_scale last_round``: every segment but the last gets loss mask 0 (and no rollout logprobs, which
    cover trained tokens only), as the multi-turn scheduler does in colocate mode. Idempotent."""
    masks = output.response_loss_mask
    if len(masks) < 2:
        return output
    new_masks = [[0] * len(m) for m in masks[:-1]] + [list(masks[-1])]
    logprobs = output.rollout_logprobs
    if len(logprobs) == len(masks):
        logprobs = [[] for _ in masks[:-1]] + [list(logprobs[-1])]
    return output.model_copy(update={"response_loss_mask": new_masks, "rollout_logprobs": logprobs})


def trainer_plays_turns(rollout_args, info: dict) -> bool:
    """ms-swift's rule: with ``--multi_turn_scheduler`` on the trainer and a single-turn server, the trainer runs
    the scheduler and each turn is one request to the server; a multi-turn server plays whole trajectories."""
    return bool(rollout_args.multi_turn_scheduler) and not info.get("enable_multi_turn")


def check_server_rollout(r, info: dict) -> None:
    """The trainer's multi-turn options (``RolloutArguments`` ``r``) against a server's ``/get_engine_type/``.

    A trainer option left at its default asks for nothing; one that is set must be what the server does. The
    trainer's ``--use_gym_env`` may differ: it decides whether the server's ``total_reward`` is a reward."""
    where = f"the rollout server ({info.get('model', '?')})"
    start = "start `grpokit rollout` with"
    if r.multi_turn_scheduler and not info.get("enable_multi_turn"):
        return  # a single-turn server: the trainer plays the turns with its own scheduler (trainer_plays_turns)
    if r.multi_turn_scheduler and r.multi_turn_scheduler != info.get("multi_turn_scheduler"):
        raise ConfigError(
            f"--multi_turn_scheduler {r.multi_turn_scheduler}: {where} runs "
            f"{info.get('multi_turn_scheduler')}; {start} --multi_turn_scheduler "
            f"{r.multi_turn_scheduler} (or a single-turn server, and the trainer plays the turns), "
            "or drop the option here"
        )
    wanted = [
        ("max_turns", r.max_turns, r.max_turns is not None),
        ("gym_env", r.gym_env, r.gym_env is not None),
        (
            "completion_length_limit_scope",
            r.completion_length_limit_scope,
            r.completion_length_limit_scope != "per_round",
        ),
    ]
    for name, value, asked in wanted:
        if not asked:
            continue
        if not info.get("enable_multi_turn"):
            raise ConfigError(
                f"--{name} {value}: {where} runs single-turn rollouts; {start} "
                f"--multi_turn_scheduler NAME --{name} {value}, or drop the option here"
            )
        if info.get(name) != value:
            raise ConfigError(
                f"--{name} {value}: {where} runs {info.get('multi_turn_scheduler')} with --{name} "
                f"{info.get(name)}; {start} --{name} {value}, or give the trainer the server's value"
            )
    if r.use_gym_env and not info.get("enable_multi_turn"):
        raise ConfigError(
            f"--use_gym_env true: {where} runs single-turn rollouts, which give no environment "
            f"reward; {start} --multi_turn_scheduler NAME (e.g. gym_scheduler)"
        )


def check_server_template(enable_thinking: bool | None, info: dict) -> None:
    """The trainer's ``--enable_thinking`` (None: unset) against the server's (``/get_engine_type/``). The trainer
    re-renders each prompt to encode what it trains on, so both must render alike. A value the trainer sets travels
    with its prompts and wins on the server; a server value the trainer lacks would make the server sample after
    another prompt than the one trained on, so it stops the run with the fix."""
    served = info.get("enable_thinking")
    if served is None or enable_thinking == served:
        return
    flag = "true" if served else "false"
    if enable_thinking is None:
        raise ConfigError(
            f"the rollout server ({info.get('model', '?')}) renders prompts with --enable_thinking "
            f"{flag}, and this trainer, which re-encodes them to train, with the chat template's "
            f"default; give the trainer --enable_thinking {flag} too (ms-swift's scripts put it on "
            "both commands)"
        )
    logger.warning(
        "--enable_thinking %s: the rollout server's %s is overridden for this trainer's prompts (the "
        "trainer's value travels with each prompt)",
        str(enable_thinking).lower(),
        flag,
    )
