"""Exceptions that the CLI turns into one line on stderr and a non-zero exit (no traceback)."""


class GrpokitError(Exception):
    """A problem the user can fix; the message says what, why and how."""


class ConfigError(GrpokitError, ValueError):
    """An option has a bad value or clashes with another option."""


class DataError(GrpokitError, ValueError):
    """A dataset is missing, unreadable or lacks a needed column."""


class PluginError(GrpokitError, ImportError):
    """A plugin file is missing or failed to import."""


class RewardError(GrpokitError, RuntimeError):
    """A reward function raised or returned scores of the wrong shape."""


class RolloutError(GrpokitError, RuntimeError):
    """A scheduler, environment or engine broke the rollout contract."""


class ServerError(GrpokitError, RuntimeError):
    """A rollout server is unreachable, timed out or answered with an error."""


class WeightSyncError(GrpokitError, RuntimeError):
    """After a weight sync the engine does not hold the trainer's weights (a checksum or the logprob probe
    differs); the message names the bucket or tensor."""
