"""The structured-output options, checked by the engines that compile them.

Registered with the option gate (``grpokit.config.checks``, slot ``sampling``; config imports no runtime package):
an invalid regex or schema fails at start-up rather than at the first rollout. ``resolve`` has already read a
schema file into its text.
"""

from __future__ import annotations

from grpokit.config.args import TrainConfig
from grpokit.config.checks import option_check
from grpokit.engines.structured import check_structured_options


@option_check("sampling")
def check_structured(cfg: TrainConfig) -> None:
    r = cfg.rollout
    if r.structured_outputs_regex or r.structured_outputs_json:
        check_structured_options(r.structured_outputs_regex, r.structured_outputs_json)
