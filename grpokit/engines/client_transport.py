"""The transport of server mode's client (engines/client.py): a server's address, and the retry policy every call
follows: connect errors, dropped connections and 429/502/503/504 are retried with exponential backoff, inside the
call's timeout; what is left at the end becomes a ``ServerError`` that names host:port.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import RetryCallState, retry_if_exception_type

from grpokit.errors import ConfigError, ServerError

RETRY_STATUS = {429, 502, 503, 504}
RETRY_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.PoolTimeout,
)


@dataclass(frozen=True)
class Endpoint:
    base_url: str

    @property
    def host(self) -> str:
        return httpx.URL(self.base_url).host

    @property
    def port(self) -> int:
        url = httpx.URL(self.base_url)
        return url.port or (443 if url.scheme == "https" else 80)

    @property
    def label(self) -> str:
        return f"{self.host}:{self.port}"


def endpoints_from(
    base_urls: Sequence[str] = (), hosts: Sequence[str] = (), ports: Sequence[int] = ()
) -> list[Endpoint]:
    """Base URLs, or hosts with one port each (or one port for all)."""
    if base_urls:
        return [Endpoint(u.rstrip("/")) for u in base_urls]
    if not hosts:
        raise ConfigError("no rollout server: give --vllm_server_host H --vllm_server_port P or --vllm_server_base_url")
    ports = list(ports) or [8000]
    if len(ports) == 1:
        ports = ports * len(hosts)
    if len(ports) != len(hosts):
        raise ConfigError(
            f"{len(hosts)} --vllm_server_host value(s) but {len(ports)} --vllm_server_port value(s); "
            "give one port, or one per host"
        )
    return [Endpoint(f"http://[{h}]:{p}" if ":" in h else f"http://{h}:{p}") for h, p in zip(hosts, ports)]


class Transient(Exception):
    """A failure worth another attempt: a busy or unavailable status, or a dropped connection."""

    def __init__(self, problem: Any) -> None:
        super().__init__(describe(problem))
        self.problem = problem


class Attempts:
    """Retry policy of one call: bounded attempts with exponential backoff, all inside ``timeout_s``; tenacity
    runs the attempts (``Retrying(**att.policy())``), this class decides what is transient and what to say."""

    def __init__(self, ep: Endpoint, what: str, timeout_s: float, retries: int, backoff_s: float) -> None:
        self.ep, self.what, self.timeout_s, self.retries, self.backoff_s = ep, what, timeout_s, retries, backoff_s
        self.start = time.monotonic()
        self.deadline = self.start + timeout_s

    def remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.5)

    def policy(self) -> dict[str, Any]:
        """Keyword arguments of ``tenacity.Retrying``/``AsyncRetrying``."""
        return {
            "retry": retry_if_exception_type(Transient),
            "stop": self._stop,
            "wait": self._wait,
            "retry_error_callback": self._give_up,
        }

    def _wait(self, rs: RetryCallState) -> float:
        return self.backoff_s * 2 ** (rs.attempt_number - 1)

    def _stop(self, rs: RetryCallState) -> bool:
        problem = rs.outcome.exception().problem
        busy = isinstance(problem, httpx.Response) and problem.status_code == 429  # busy: retry until the deadline
        return (rs.attempt_number > self.retries and not busy) or time.monotonic() + self._wait(rs) >= self.deadline

    def _give_up(self, rs: RetryCallState) -> Any:
        error = rs.outcome.exception()
        raise ServerError(
            f"rollout server {self.ep.label} did not answer {self.what} after {rs.attempt_number} "
            f"attempt(s) in {time.monotonic() - self.start:.1f}s ({describe(error.problem)}); check "
            f"that `grpokit rollout` is running there and reachable"
        ) from error

    @contextlib.contextmanager
    def translating(self) -> Iterator[None]:
        """httpx's errors as grpokit's: transient ones to retry, a timeout or a refusal as ServerError."""
        try:
            yield
        except RETRY_ERRORS as e:
            raise Transient(e) from e
        except httpx.TimeoutException as e:
            raise ServerError(
                f"rollout server {self.ep.label} did not finish {self.what} within "
                f"{self.timeout_s:g}s ({describe(e)}); raise --vllm_server_timeout or send smaller "
                "batches"
            ) from e
        except httpx.HTTPError as e:
            raise ServerError(f"rollout server {self.ep.label}: {self.what} failed ({describe(e)})") from e

    def answer(self, resp: httpx.Response) -> Any:
        """The JSON answer; ``Transient`` for a transient status; ServerError for a refusal."""
        if resp.status_code in RETRY_STATUS:
            raise Transient(resp)
        if resp.status_code >= 400:
            raise ServerError(f"rollout server {self.ep.label} refused {self.what}: {describe(resp)}")
        try:
            return resp.json()
        except ValueError as e:
            raise ServerError(
                f"rollout server {self.ep.label} answered {self.what} with non-JSON ({resp.text[:80]!r})"
            ) from e


def describe(problem: Any) -> str:
    if isinstance(problem, httpx.Response):
        try:
            message = problem.json().get("error") or problem.text
        except (ValueError, AttributeError):
            message = problem.text
        return f"HTTP {problem.status_code}: {str(message)[:300]}"
    return f"{type(problem).__name__}: {problem}"
