"""``GRPOConfig`` with TRL's field names, turned into grpokit's options (and checked by grpokit's parser).

A field whose TRL name is a grpokit option passes as it is (``learning_rate``, ``num_generations``, ``beta``,
``epsilon``, ``loss_type`` ...); ``RENAMED`` maps the ones grpokit calls otherwise; a field in neither is refused
with its name. Defaults are grpokit's, not TRL's: give a field to have its value."""

from __future__ import annotations

from typing import Any

from grpokit.config.args import ALL_GROUPS
from grpokit.errors import ConfigError

# TRL's name → grpokit's option
RENAMED: dict[str, str] = {
    "mask_truncated_completions": "overlong_filter",
    "shuffle_dataset": "dataset_shuffle",
}
# TRL fields with no grpokit option, and what to do instead
REFUSED: dict[str, str] = {
    "model_init_kwargs": "pass --torch_dtype as torch_dtype, or a model folder",
    "use_liger_kernel": "grpokit computes logps in chunks in the output head's place (--logps_chunk_size)",
    "use_liger_loss": "grpokit computes logps in chunks in the output head's place (--logps_chunk_size)",
    "push_to_hub": "push the final model yourself",
    "hub_model_id": "push the final model yourself",
    "deepspeed": "pass a preset name or file path string (zero0 ... zero3_offload)",
}


class GRPOConfig:
    """TRL's ``GRPOConfig(output_dir=..., **fields)``. ``flags()`` gives the grpokit command-line options."""

    def __init__(self, output_dir: str | None = None, **fields: Any) -> None:
        self.output_dir = output_dir
        self.fields = dict(fields)
        for name, value in fields.items():
            setattr(self, name, value)

    def flags(self) -> list[str]:
        known = {f for group in ALL_GROUPS for f in group.__dataclass_fields__}
        out = ["--output_dir", str(self.output_dir)] if self.output_dir else []
        for name, value in self.fields.items():
            if value is None:
                continue
            option = RENAMED.get(name, name)
            if name == "deepspeed" and isinstance(value, str):
                option = "deepspeed"
            elif name in REFUSED or option not in known:
                fix = REFUSED.get(name, "grpokit has no such option (grpokit train --help lists them)")
                raise ConfigError(f"GRPOConfig({name}=...): not supported by grpokit; {fix}")
            out += [f"--{option}", *_values(value)]
        return out


def _values(value: Any) -> list[str]:
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _values(item)]
    if isinstance(value, dict):
        import json

        return [json.dumps(value)]
    return [str(value)]
