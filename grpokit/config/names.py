"""Options whose value is a name in one of the algorithm registries, which a plugin may extend.

``--loss_type`` and friends are plain strings: a plugin given with ``--external_plugins`` registers a new name
(``POLICY_LOSSES["vanilla_pg"] = ...``) and then selects it. The configuration checks the names only after the
plugins have loaded (``grpokit.config.validate``), against the live registries, before any model loads.

``grpokit train --help`` lists the names too. The registries live in ``grpokit.algorithms``, which imports torch,
and plain ``--help`` must not (it answers in under a second): until that package is imported, the help shows
``BUILTIN_NAMES`` below, a torch-free copy of what grpokit itself registers (a unit test keeps it equal to the
registries). Importing the package hands its registries to ``LIVE`` (config imports no runtime package; see
``config/checks.py``) — ``grpokit train --external_plugins p.py --help`` loads the plugins first — and from then
on the help lists the live registries, plugin names included.
"""

from __future__ import annotations

from grpokit.config.checks import load_components

# option -> the registries (attributes of grpokit.algorithms) a name must be in
REGISTRIES: dict[str, tuple[str, ...]] = {
    "advantage_estimator": ("ADVANTAGE_ESTIMATORS",),
    "scale_rewards": ("SCALE_MODES",),
    "loss_type": ("POLICY_LOSSES", "LOSS_NORMALIZERS"),
    "importance_sampling_level": ("IS_LEVELS",),
    "rollout_importance_sampling_mode": ("ROLLOUT_IS_MODES",),
}

# what grpokit registers itself, for --help without torch (tests/unit/test_config_cli.py compares)
BUILTIN_NAMES: dict[str, tuple[str, ...]] = {
    "advantage_estimator": ("grpo", "rloo", "reinforce_plus_plus"),
    "scale_rewards": ("group", "batch", "none", "gdpo"),
    "loss_type": ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "real"),
    "importance_sampling_level": ("token", "sequence", "sequence_token"),
    "rollout_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
}


# option -> its live registries, in REGISTRIES' order: filled when grpokit.algorithms is imported
LIVE: dict[str, tuple[dict, ...]] = {}


def registered_names(option: str) -> list[str]:
    """The names usable for ``--option`` now, in registration order (imports grpokit.algorithms, so torch)."""
    load_components()
    return _live_names(option)


def help_names(option: str) -> list[str]:
    """For ``--help``: the live registry once grpokit.algorithms is imported, else the built-in names."""
    if option in LIVE:
        return _live_names(option)
    return list(BUILTIN_NAMES[option])


def _live_names(option: str) -> list[str]:
    first, *others = LIVE[option]
    return [name for name in first if all(name in other for other in others)]


def help_suffix(option: str) -> str:
    names = ", ".join(help_names(option)).replace("%", "%%")  # argparse %-formats help text
    return f"; registered: {names} (a plugin may add more)"
