"""Secrets kept out of what a run writes and shows: args.json, the trackers' config, the logs, report.html.

An option is secret when a word of its name (split at ``_``, ``-`` and ``.``) is one of ``SECRET_WORDS``
(``api_key``, ``hub_token``, ``wandb_password``, ``client_secret``; not ``max_tokens``, nor a lookup key like
``teacher_tag_key``), wherever its value came from (a flag, a YAML file, the environment). Its value becomes
``REDACTED``, as does the password of a URL (``http://u:pw@host``) in any value, and any value that equals a secret
environment variable's (``*_KEY``, ``*_TOKEN``, ... of 8 or more characters). Nested dicts and lists are walked. The
command line's log handlers get ``RedactingFilter``, which does the same to every log line, the run's secret option
values included. The Python API (grpokit.trl), whose caller owns the handlers, redacts every log record made while
it works instead (``redacting_logs``), whatever handler later receives it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

REDACTED = "<redacted>"
SECRET_WORDS = frozenset(
    {"key", "apikey", "token", "secret", "password", "passwd", "pwd", "credential", "credentials", "auth"}
)
_WORD = re.compile(r"[_\-.\s]+")
# a scheme starts a word and is short: each position is tried in bounded time (a long run of letters is no scheme;
# an unbounded ``[a-z0-9+.-]*`` made a 5 MB string quadratic)
_URL_PASSWORD = re.compile(
    r"(?<![a-z0-9+.\-])(?P<scheme>[a-z][a-z0-9+.\-]{0,31}://)(?P<user>[^/@:\s]{0,256}):(?P<password>[^/@\s]+)@",
    re.I,
)
MIN_ENV_SECRET = 8


# "key" after one of these words names a lookup key, not a secret (--teacher_tag_key holds a column's name)
LOOKUP_KEY_WORDS = frozenset({"tag", "column", "sort", "group", "label", "data", "dataset", "prompt", "cache", "dict"})


def is_secret_name(name: str) -> bool:
    """Whether an option or variable named ``name`` holds a secret (module docstring)."""
    words = [word for word in _WORD.split(str(name).lower()) if word]
    return any(
        word in SECRET_WORDS and not (word == "key" and i > 0 and words[i - 1] in LOOKUP_KEY_WORDS)
        for i, word in enumerate(words)
    )


def env_secrets(environ: dict | None = None) -> frozenset[str]:
    """Values of the environment's secret variables, long enough not to match ordinary values by chance."""
    env = os.environ if environ is None else environ
    return frozenset(v for k, v in env.items() if is_secret_name(k) and len(v) >= MIN_ENV_SECRET)


def redact_text(text: str, secrets: frozenset[str] = frozenset()) -> str:
    """``text`` with URL passwords and the given secret values replaced."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def redacted(value: Any, secrets: frozenset[str] | None = None, _depth: int = 0) -> Any:
    """``value`` (options, a row) with every secret replaced (module docstring); the input is not changed."""
    secrets = env_secrets() if secrets is None else secrets
    if _depth > 64:
        return REDACTED  # deeper than any option holds: nothing of it is shown
    if isinstance(value, dict):
        return {
            k: (REDACTED if is_secret_name(k) and v not in (None, "", False) else redacted(v, secrets, _depth + 1))
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redacted(v, secrets, _depth + 1) for v in value]
    if isinstance(value, str):
        return redact_text(value, secrets)
    return value


_known: set[str] = set()  # values of secret options of this process's run (remember_secrets)


def remember_secrets(options: dict) -> None:
    """Keep the values of ``options``' secret options (a flag or YAML key the environment does not hold) so that
    the log filter redacts them too."""
    for k, v in options.items():
        if is_secret_name(k) and isinstance(v, str) and len(v) >= 4:
            _known.add(v)


def redact_line(text: str) -> str:
    """A line the process prints itself (an error, a stop) with URL passwords, secret environment values and the
    run's secret option values replaced, as ``RedactingFilter`` does to log lines."""
    return redact_text(text, env_secrets() | frozenset(_known))


class RedactingFilter(logging.Filter):
    """A log handler's filter: every record's message with URL passwords, secret environment values and the run's
    secret option values replaced."""

    def __init__(self) -> None:
        super().__init__()
        self.env = env_secrets()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not format: its handler reports it
            return True
        shown = redact_text(message, self.env | frozenset(_known))
        if shown != message:
            record.msg, record.args = shown, None
        return True


def install_log_redaction() -> None:
    """Put a ``RedactingFilter`` on every handler of the root logger (once)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


@contextlib.contextmanager
def redacting_logs() -> Iterator[None]:
    """Every log record made in the block, by any logger and thread, has its message redacted as
    ``RedactingFilter`` does, before any handler sees it (handlers added later and a library's own included); the
    record factory that was in place is used and put back."""
    previous = logging.getLogRecordFactory()
    redact = RedactingFilter()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        redact.filter(record)
        return record

    logging.setLogRecordFactory(factory)
    try:
        yield
    finally:
        if logging.getLogRecordFactory() is factory:
            logging.setLogRecordFactory(previous)
