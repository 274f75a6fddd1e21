"""The trainer's side of the one-trainer-per-server claim (the rule is in grpokit/server/claim.py).

``TrainerClaim`` names the run (one id for all of a launch's processes: each sends it as the ``X-Grpokit-Trainer``
header), claims every server at the start (the main process only), renews the claim from a daemon thread, and
releases it when the client closes. A server that does not know ``/claim/`` (an older grpokit, another project's
server) is used unclaimed, with a warning.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import httpx

from grpokit.errors import ServerError

logger = logging.getLogger(__name__)
CLAIM_HEADER = "x-grpokit-trainer"
RENEW_S = 5.0  # the server's lease is 30 s: six renewals per lease


def run_id() -> str:
    """This launch's id, the same in each of its processes: from torchrun's rendezvous (address, port, run id)
    under a launcher, else random."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        key = ":".join(os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))
        return "run-" + hashlib.sha256(key.encode()).hexdigest()[:24]
    return "run-" + uuid.uuid4().hex[:24]


class TrainerClaim:
    def __init__(self, headers: dict[str, str], timeout: float) -> None:
        self.trainer = run_id()
        self.header = {CLAIM_HEADER: self.trainer}
        self._http = httpx.Client(headers={**headers, **self.header}, timeout=min(timeout, 10.0))
        self._urls: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, endpoints) -> None:
        """Claim every server (the main process of a launch); ServerError with the server's line when another
        live trainer holds one."""
        body = {"trainer": self.trainer, "pid": os.getpid(), "host": socket.gethostname()[:255]}
        for ep in endpoints:
            resp = self._post(ep, body)
            if resp.status_code == 409:
                resp = self._after_refusal(ep, body, resp)
            if resp.status_code in (404, 405):
                logger.warning(
                    "rollout server %s does not take claims (not a current grpokit server): it is "
                    "used unclaimed, so another trainer could share it",
                    ep.label,
                )
                continue
            if resp.status_code != 200:
                raise ServerError(f"rollout server {ep.label}: {_error_of(resp)}")
            self._urls.append(ep.base_url)
        if self._urls:
            self._thread = threading.Thread(target=self._renew, args=(body,), name="grpokit-claim", daemon=True)
            self._thread.start()
            atexit.register(self.release)  # a run that ends on an error frees the servers too (kill -9: the lease)

    def _post(self, ep, body: dict) -> httpx.Response:
        try:
            return self._http.post(ep.base_url + "/claim/", json=body)
        except httpx.HTTPError as e:
            raise ServerError(f"rollout server {ep.label}: claiming it failed ({type(e).__name__}: {e})") from e

    def _after_refusal(self, ep, body: dict, resp: httpx.Response) -> httpx.Response:
        """A claim held by a trainer that is gone: on this host with its pid gone, taken over at once; silent for
        more than two renewals elsewhere, claimed again once its lease has run out. Else the refusal stands."""
        try:
            answer = resp.json()
            holder, lease = answer["holder"], float(answer["lease_s"])
            pid, host, idle = int(holder["pid"]), str(holder["host"]), float(holder["idle_s"])
        except (ValueError, KeyError, TypeError):
            return resp
        if host == socket.gethostname() and pid > 0 and (pid == os.getpid() or not _alive(pid)):
            # a trainer of this very process that ended without closing its client (a run that raised, in a
            # notebook or a test), or a process that is gone: nobody else is using the server
            why = "an earlier trainer of this process" if pid == os.getpid() else f"pid {pid}, which is gone"
            logger.warning("rollout server %s: taking over the claim of %s", ep.label, why)
            return self._post(ep, {**body, "replaces": holder["trainer"]})
        if idle > 2 * RENEW_S:
            wait = max(0.0, lease - idle) + 1.0
            logger.warning(
                "rollout server %s: claimed by pid %d on %s, silent for %.0f s; waiting %.0f s for its claim to expire",
                ep.label,
                pid,
                host,
                idle,
                wait,
            )
            time.sleep(wait)
            return self._post(ep, body)
        return resp

    def _renew(self, body: dict) -> None:
        while not self._stop.wait(RENEW_S):
            for url in self._urls:
                try:
                    resp = self._http.post(url + "/claim/", json=body)
                except httpx.HTTPError:
                    continue  # the server is down: the run's own calls say so
                if resp.status_code == 409:  # taken over (this trainer was found gone): no longer ours to renew
                    logger.warning("rollout server %s: this trainer's claim was taken: %s", url, _error_of(resp))
                    self._urls = [u for u in self._urls if u != url]

    def release(self) -> None:
        """Give the servers back (idempotent: at the client's close, and at exit)."""
        atexit.unregister(self.release)
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        for url in self._urls:
            try:
                self._http.post(url + "/release/", json={"trainer": self.trainer})
            except httpx.HTTPError:
                pass  # a server that is gone holds no claim
        self._http.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # exited and not reaped yet
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[:1] != ["Z"]
    except OSError:
        return True


def _error_of(resp: httpx.Response) -> str:
    try:
        error = resp.json().get("error")
    except ValueError:
        error = None
    return str(error)[:500] if error else f"HTTP {resp.status_code}"
