"""Hugging Face Hub datasets, failing fast when the hub cannot be reached.

``datasets.load_dataset`` retries an unreachable hub for ~25 s before it gives up; a quick probe of the endpoint
first turns that into an immediate one-line ``DataError``. With ``HF_HUB_OFFLINE=1`` (or ``HF_DATASETS_OFFLINE=1``)
no probe is made and only the local cache is read.
"""

from __future__ import annotations

from urllib.parse import urlparse

from grpokit.errors import DataError

PROBE_TIMEOUT_S = 3.0
_FIX = "pass a local file (.jsonl/.json/.csv/.parquet) or builtin:<task>, e.g. builtin:arithmetic"


def _offline() -> bool:
    import datasets.config
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE or datasets.config.HF_DATASETS_OFFLINE)


def hub_unreachable_reason(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the hub endpoint answers an HTTP request within ``timeout`` seconds, else the reason."""
    import httpx
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    if not urlparse(endpoint).hostname:
        return f"bad endpoint {endpoint!r}"
    try:
        httpx.head(endpoint, timeout=timeout, follow_redirects=False)  # any status code means the host answered
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__} for {endpoint}"
    return None


def load_hub_dataset(repo: str, subset: str | None):
    """``datasets.load_dataset(repo, subset, split="train")`` with one-line errors instead of long retries."""
    import datasets

    name = repo if subset is None else f"{repo}:{subset}"
    offline = _offline()
    if not offline:
        reason = hub_unreachable_reason()
        if reason is not None:
            raise DataError(f"could not reach the hub for {name!r} ({reason}); {_FIX}")
    try:
        return datasets.load_dataset(repo, subset, split="train")
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        if offline:
            raise DataError(
                f"could not load hub dataset {name!r} from the local cache with offline mode on (HF_HUB_OFFLINE): "
                f"{type(exc).__name__}: {first}; {_FIX}"
            ) from exc
        raise DataError(f"could not load hub dataset {name!r} ({type(exc).__name__}: {first}); {_FIX}") from exc
