"""``swift.template``: ``Template`` (grpokit's chat template; reward-model plugins get an ``RMTemplate``, which
adds ms-swift's ``encode``/``data_collator``) and the ``Messages`` type."""

from typing import Any

from grpokit.template.encode import ChatTemplate as Template  # noqa: F401 (re-exported)

Messages = list[dict[str, Any]]

__all__ = ["Messages", "Template"]
