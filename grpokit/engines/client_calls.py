"""How a rollout client cuts one window into /infer/ calls (whole groups per server, then by the server's count
and body limits) and maps the answers back; and what it requires of the servers' engines."""

from __future__ import annotations

from collections.abc import Sequence

from grpokit.errors import ConfigError, ServerError
from grpokit.protocol import RolloutInferRequest, RolloutOutput


def check_partial_rollouts(infos: list[dict]) -> None:
    """--partial_rollouts needs servers whose engine pauses and continues generation on a weight update."""
    engines = sorted({str(i.get("engine_type", "?")) for i in infos if not i.get("partial_rollouts")})
    if engines:
        raise ConfigError(
            f"--partial_rollouts true: not implemented for the rollout server's {', '.join(engines)} "
            "engine yet (the transformers and vLLM engines pause and continue); use --partial_rollouts false"
        )


def split_requests(requests: Sequence[RolloutInferRequest], n_servers: int) -> list[list[int]]:
    """Indices per server: whole ``prompt_id`` groups, each to the least-loaded server so far, in order."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.prompt_id, []).append(i)
    parts: list[list[int]] = [[] for _ in range(n_servers)]
    for idx in groups.values():
        min(parts, key=len).extend(idx)
    return [sorted(p) for p in parts]


def split_by_size(sizes: Sequence[int], max_count: int, max_bytes: int) -> list[list[int]]:
    """Consecutive positions grouped so that each group has at most ``max_count`` items whose ``sizes`` add up to
    at most ``max_bytes`` (the server's --max_batch_requests and --max_body_mb). ServerError when one item alone
    is larger: no split can send it."""
    parts: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if size > max_bytes:
            raise ServerError(
                f"one rollout request is {size / 1024 / 1024:.1f} MB as JSON, more than the rollout "
                f"server's body limit ({max_bytes / 1024 / 1024:.1f} MB after the call's envelope); "
                "shorten the prompt or the row's columns (--vllm_server_pass_dataset false keeps "
                "them on the trainer), or start the server with a larger --max_body_mb"
            )
        if not parts or len(parts[-1]) >= max_count or used + size > max_bytes:
            parts.append([])
            used = 0
        parts[-1].append(i)
        used += size
    return parts


def output_positions(
    requests: Sequence[RolloutInferRequest], idx: list[int], outputs: list[RolloutOutput]
) -> list[int]:
    """The request position of each output. Outputs come in request order (one or more per request)."""
    pos, j = [], 0
    for o in outputs:
        k = j
        while k < len(idx) and requests[idx[k]].request_id != o.request_id:
            k += 1
        if k < len(idx):
            j = k
        pos.append(idx[min(j, len(idx) - 1)])
    return pos
