"""The rules of asynchronous training (--max_staleness, --async_generate) that need no engine: their names in
messages, and the bound against one window's optimizer steps."""

from __future__ import annotations

from grpokit.config.plan import BatchPlan
from grpokit.errors import ConfigError


def async_option(r) -> str:
    """How the user asked for asynchronous training, for messages."""
    return f"--max_staleness {r.max_staleness}" if r.max_staleness else "--async_generate true"


def check_partial_rollouts(r, server: bool) -> None:
    """--partial_rollouts: a rollout server's engine or vLLM colocate pauses and continues; only while rolling
    out ahead."""
    if not r.partial_rollouts:
        return
    if not (server or r.use_vllm):
        raise ConfigError(
            "--partial_rollouts true: implemented in server mode (--vllm_mode server) and for vLLM colocate "
            "(--use_vllm true); the in-process transformers engine samples from the live weights, so no weight "
            "update ever lands during its rollout"
        )
    if not r.async_generate:
        raise ConfigError(
            "--partial_rollouts true continues rollouts across weight updates, which only happen "
            "during a rollout when windows are rolled out ahead: add --max_staleness K (K ≥ 1)"
        )
    if r.structured_outputs_regex or r.structured_outputs_json:
        raise ConfigError(
            "--partial_rollouts true with structured outputs: a grammar cannot resume mid-completion "
            "on new weights; drop one of the two"
        )


def check_staleness(r, plan: BatchPlan) -> None:
    """A window rolled out ahead is at least one window's optimizer steps old when it trains; --stream_groups."""
    k, steps = r.max_staleness, plan.optimizer_steps_per_window
    if k and k < steps:
        raise ConfigError(
            f"--max_staleness {k}: one window trains {steps} optimizer steps (steps_per_generation / "
            "gradient_accumulation_steps × num_iterations), so a window rolled out ahead is at least "
            f"{steps} steps old; use --max_staleness {steps} or more (each further {steps} lets one "
            "more window roll out ahead), or 0 to train synchronously"
        )
    if k and r.staleness_policy == "drop" and plan.world_size > 1:
        raise ConfigError(
            f"--staleness_policy drop with {plan.world_size} processes: not implemented yet (each "
            "process would drop windows by its own timing, and they must train the same windows); "
            "use --staleness_policy wait"
        )
    check_stream_groups(r, plan)


def check_stream_groups(r, plan: BatchPlan) -> None:
    """--stream_groups: groups from the buffer of --max_staleness, one training process."""
    if not getattr(r, "stream_groups", False):
        return
    if not r.async_generate:
        raise ConfigError(
            "--stream_groups true takes groups from the buffer of asynchronous training as they finish: add "
            f"--max_staleness K (K ≥ {plan.optimizer_steps_per_window}, one window's optimizer steps)"
        )
    if plan.world_size > 1:
        raise ConfigError(
            f"--stream_groups true with {plan.world_size} processes: not implemented yet (every process would "
            "have to train groups finished at the same moment); use one training process, or --stream_groups false"
        )
