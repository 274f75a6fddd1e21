"""The rules of asynchronous training (--max_staleness, --async_generate) that need no engine: their names in
messages, and the bound against one window's optimizer steps."""

from __future__ import annotations

from grpokit.config.plan import BatchPlan
from grpokit.errors import ConfigError


def async_option(r) -> str:
    """How the user asked for asynchronous training, for messages."""
    return f"--max_staleness {r.max_staleness}" if r.max_staleness else "--async_generate true"


def check_staleness(r, plan: BatchPlan) -> None:
    """A window rolled out ahead is at least one window's optimizer steps old when it trains."""
    k, steps = r.max_staleness, plan.optimizer_steps_per_window
    if k and k < steps:
        raise ConfigError(f"--max_staleness {k}: one window trains {steps} optimizer steps (steps_per_generation / "
                          "gradient_accumulation_steps × num_iterations), so a window rolled out ahead is at least "
                          f"{steps} steps old; use --max_staleness {steps} or more (each further {steps} lets one "
                          "more window roll out ahead), or 0 to train synchronously")

