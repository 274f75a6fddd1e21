"""Trainer side of server mode: ``RolloutClient`` talks HTTP to one or several ``grpokit rollout`` servers.

It implements the ``InferEngine`` interface (``infer``, ``sync_weights``, ``reset_prefix_cache``, ``close``) and
returns whole trajectories with ``infer_trajectories``; ``grpokit.rollout.remote.RemoteScheduler`` wraps it so
that the trainer, which
only talks to a scheduler, runs unchanged in server mode (multi-turn then runs inside the server).

Requests are split across servers keeping each ``prompt_id`` group on one server, then into calls that stay
under each server's ``--max_batch_requests`` and ``--max_body_mb`` (both reported by ``/get_engine_type/``), sent
in parallel; the outputs come back in request order. Every call has a timeout; connect errors, dropped connections and
429/502/503/504 are retried a few times with exponential backoff, inside that timeout. A dead server becomes a
``ServerError`` that names host:port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx
from tenacity import AsyncRetrying, Retrying

from grpokit.aio import run_sync
from grpokit.engines.adapters import AdapterSync
from grpokit.engines.base import InferEngine
from grpokit.engines.client_calls import check_partial_rollouts, output_positions, split_by_size, split_requests
from grpokit.engines.client_transport import Attempts, describe, endpoints_from
from grpokit.engines.media_wire import images_from_wire, request_to_wire
from grpokit.engines.server_claim import TrainerClaim
from grpokit.engines.sync_check.checksums import SyncReport, check_body, check_servers
from grpokit.engines.weight_sender import WeightSender, sends_here
from grpokit.errors import ServerError
from grpokit.protocol import ChatCompletionResponse, RequestConfig, RolloutInferRequest, RolloutOutput
from grpokit.wire.checksum import SumsOf
from grpokit.wire.weights import parse_dtype

logger = logging.getLogger(__name__)

BODY_ENVELOPE_BYTES = 64  # '{"requests": [', '], "request_config": ' and '}' around the parts that are measured


class RolloutClient(InferEngine):
    """HTTP client of one or several rollout servers, usable wherever an ``InferEngine`` is."""

    engine_type = "server"

    def __init__(
        self,
        base_urls: Sequence[str] = (),
        hosts: Sequence[str] = (),
        ports: Sequence[int] = (),
        timeout: float = 240.0,
        api_key: str | None = None,
        bucket_mb: int = 256,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        wait: bool = True,
        infer_on_loop_thread: bool = False,
        partial_rollouts: bool = False,
        claim: bool = False,
        lora: AdapterSync | None = None,
    ) -> None:
        super().__init__(infer_on_loop_thread)
        self._adapters = lora  # adapter-only weight sync (--vllm_enable_lora, engines/adapters.py); None: merged
        self._synced_version: int | None = None  # the LoRA version the last sync loaded (None: merged weights)
        self.endpoints = endpoints_from(base_urls, hosts, ports)
        self.timeout, self.max_retries, self.backoff_s = float(timeout), max_retries, backoff_s
        api_key = api_key or os.environ.get("GRPOKIT_API_KEY") or None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._claim = TrainerClaim(self._headers, self.timeout) if claim else None  # a trainer's: one per server
        self._headers.update(self._claim.header if self._claim else {})
        self._http = httpx.Client(headers=self._headers, timeout=self.timeout)
        self._infos: list[dict] | None = None

        post = lambda i, path, body, t: self._request(i, "POST", path, body, timeout=t, retries=0)  # noqa: E731
        self._sender = WeightSender(
            [(e.host, e.port) for e in self.endpoints], post, bucket_mb, self.timeout, interrupt=partial_rollouts
        )
        if wait:
            self.wait_for_server()
        if self._claim is not None and os.environ.get("RANK", "0") == "0":  # the launch's main process claims
            self._claim.take(self.endpoints)

    @classmethod
    def from_args(cls, r, infer_on_loop_thread: bool = False) -> RolloutClient:
        """A training run's client, from ``RolloutArguments`` (``vllm_server_*``, ``weight_sync_bucket_mb``,
        ``partial_rollouts``): waits for the servers and claims them (one trainer per server)."""
        return cls(
            base_urls=r.vllm_server_base_url,
            hosts=r.vllm_server_host,
            ports=r.vllm_server_port,
            timeout=r.vllm_server_timeout,
            api_key=r.vllm_server_api_key,
            bucket_mb=r.weight_sync_bucket_mb,
            infer_on_loop_thread=infer_on_loop_thread,
            partial_rollouts=r.partial_rollouts,
            claim=True,
            lora=AdapterSync.for_run(r, "the rollout server"),
        )

    # -- HTTP ----------------------------------------------------------------------------------------------
    def _request(
        self, i: int, method: str, path: str, body: Any = None, timeout: float | None = None, retries: int | None = None
    ) -> Any:
        ep = self.endpoints[i]
        att = Attempts(
            ep,
            f"{method} {path}",
            self.timeout if timeout is None else timeout,
            self.max_retries if retries is None else retries,
            self.backoff_s,
        )
        for attempt in Retrying(**att.policy()):
            with attempt, att.translating():
                return att.answer(self._http.request(method, ep.base_url + path, json=body, timeout=att.remaining()))

    async def _request_async(self, http: httpx.AsyncClient, i: int, path: str, body: Any) -> Any:
        ep = self.endpoints[i]
        att = Attempts(ep, f"POST {path}", self.timeout, self.max_retries, self.backoff_s)
        async for attempt in AsyncRetrying(**att.policy()):
            with attempt, att.translating():
                return att.answer(await http.post(ep.base_url + path, json=body, timeout=att.remaining()))

    def wait_for_server(self, timeout: float | None = None) -> None:
        """Poll ``/health/`` on every server until it answers; ServerError naming host:port after ``timeout``."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for ep in self.endpoints:
            last: Any = None
            while True:
                try:
                    resp = self._http.get(ep.base_url + "/health/", timeout=min(5.0, max(timeout, 0.5)))
                    if resp.status_code == 200:
                        break
                    if resp.status_code == 401:
                        raise ServerError(
                            f"rollout server {ep.label} rejected the API key; give the key of "
                            "`grpokit rollout --api_key` as --vllm_server_api_key (or GRPOKIT_API_KEY)"
                        )
                    last = resp
                except httpx.HTTPError as e:
                    last = e
                if time.monotonic() + 0.5 >= deadline:
                    raise ServerError(
                        f"rollout server {ep.label} is not reachable after {timeout:g}s ({describe(last)}); start it "
                        f"with `grpokit rollout --model M --host {ep.host} --port {ep.port}` or fix "
                        "--vllm_server_host/--vllm_server_port (--vllm_server_timeout sets the wait)"
                    )
                time.sleep(0.5)

    # -- engine interface ----------------------------------------------------------------------------------
    def engine_info(self, refresh: bool = False) -> dict:
        """``/get_engine_type/`` of the first server (engine, multi-turn, gym env, max_turns, dtype, device)."""
        if self._infos is None or refresh:
            self._infos = [self._request(i, "GET", "/get_engine_type/") for i in range(len(self.endpoints))]
        return {**self._infos[0], "num_servers": len(self.endpoints)}

    def _limits(self) -> tuple[int, int]:
        """Requests and body bytes per /infer/ call that every server accepts (its --max_batch_requests and
        --max_body_mb; a server that does not report a limit gets grpokit's default)."""
        self.engine_info()
        count = min(int(info.get("max_batch_requests") or 4096) for info in self._infos)
        body = min(float(info.get("max_body_mb") or 64.0) for info in self._infos)
        return count, int(body * 1024 * 1024)

    async def _infer_positions(
        self, requests: Sequence[RolloutInferRequest], config: RequestConfig, only: int | None = None
    ) -> list[tuple[int, RolloutOutput]]:
        requests = list(requests)
        if not requests:
            return []
        max_batch, max_bytes = await asyncio.to_thread(self._limits)
        if config.weight_version is None and self._synced_version is not None:  # sample the version synced last
            config = config.model_copy(update={"weight_version": self._synced_version})
        conf, dumped = self._wire(requests, config)
        sizes = [len(json.dumps(d, ensure_ascii=False).encode()) + 1 for d in dumped]  # + the comma
        budget = max_bytes - len(json.dumps(conf).encode()) - BODY_ENVELOPE_BYTES
        calls = []
        shares = (
            split_requests(requests, len(self.endpoints))
            if only is None  # else all to server ``only``
            else [list(range(len(requests))) if i == only else [] for i in range(len(self.endpoints))]
        )
        for i, idx in enumerate(shares):
            for part in split_by_size([sizes[j] for j in idx], max_batch, budget):
                calls.append((i, [idx[k] for k in part]))
        async with httpx.AsyncClient(headers=self._headers, timeout=self.timeout) as http:
            answers = await asyncio.gather(
                *(
                    self._request_async(http, server, "/infer/", self._infer_body([dumped[j] for j in idx], conf))
                    for server, idx in calls
                )
            )
        tagged: list[tuple[int, RolloutOutput]] = []
        for (server, idx), answer in zip(calls, answers, strict=True):
            outputs = self._outputs(answer, requests, idx, f"rollout server {self.endpoints[server].label}")
            tagged.extend(zip(output_positions(requests, idx, outputs), outputs))
        tagged.sort(key=lambda t: t[0])  # stable: a request's outputs keep their order
        return tagged

    # -- the /infer/ wire, which a client of another protocol overrides (engines/swift_client.py) ----------------
    def _wire(self, requests: list[RolloutInferRequest], config: RequestConfig) -> tuple[dict, list[dict]]:
        """The request config and each request as sent; images as base64 (engines/media_wire.py)."""
        conf = config.model_dump(mode="json")
        if conf["weight_version"] is None:  # unset: the newest, and a server without the field takes the body
            del conf["weight_version"]
        return conf, [request_to_wire(r) for r in requests]

    def _infer_body(self, dumped: list[dict], conf: dict) -> dict:
        return {"requests": dumped, "request_config": conf}

    def _outputs(self, answer, requests: list[RolloutInferRequest], idx: list[int], where: str) -> list[RolloutOutput]:
        """One call's answer as outputs (ServerError for an answer of another shape)."""
        try:
            outputs = [RolloutOutput.model_validate(o) for o in answer]
        except (TypeError, ValueError) as e:
            raise ServerError(
                f"{where} answered /infer/ with outputs that are not RolloutOutput ({str(e).splitlines()[0]})"
            ) from e
        for o in outputs:  # a trajectory's images come back as base64: bytes for the trainer's processor
            if "images" in o.rollout_infos:
                o.rollout_infos["images"] = images_from_wire(o.rollout_infos["images"], o.request_id)
        return outputs

    async def infer_trajectories_async(
        self, requests: Sequence[RolloutInferRequest], config: RequestConfig, server: int | None = None
    ) -> list[RolloutOutput]:
        """Whole trajectories from the servers' schedulers, in request order (several per request possible); all
        from server number ``server`` where given, else each group to the least-loaded server."""
        return [o for _, o in await self._infer_positions(requests, config, server)]

    def infer_trajectories(self, requests: Sequence[RolloutInferRequest], config: RequestConfig) -> list[RolloutOutput]:
        """Synchronous ``infer_trajectories_async``."""
        return run_sync(self.infer_trajectories_async(requests, config))

    def infer(self, requests: list[RolloutInferRequest], config: RequestConfig) -> list[ChatCompletionResponse]:
        """One response per request with ``config.n`` choices (each choice is one trajectory's last turn)."""
        n = config.n
        single = config.model_copy(update={"n": 1})
        copies = [r.model_copy(update={"request_id": uuid.uuid4().hex}) for r in requests for _ in range(n)]
        tagged = run_sync(self._infer_positions(copies, single))
        by_copy: dict[int, RolloutOutput] = {}
        for pos, out in tagged:
            by_copy.setdefault(pos, out)
        responses = []
        for i in range(len(requests)):
            outs = [by_copy.get(i * n + k) for k in range(n)]
            if any(o is None for o in outs):
                raise ServerError(f"the rollout server returned no output for request {requests[i].request_id}")
            choices = [o.response.choices[-1].model_copy(update={"index": k}) for k, o in enumerate(outs)]
            responses.append(
                ChatCompletionResponse(
                    model=outs[0].response.model, choices=choices, prompt_token_ids=outs[0].response.prompt_token_ids
                )
            )
        return responses

    def probe(self, request: RolloutInferRequest, config: RequestConfig) -> ChatCompletionResponse:
        """The weight-sync check's greedy probe on the first server (``POST /probe/``): it runs on the new weights
        at once, where an /infer/ call would queue behind the rollout in flight."""
        prompt = request.messages[-1]["content"]
        answer = self._request(0, "POST", "/probe/", {"prompt": prompt, "max_tokens": config.max_tokens})
        return ChatCompletionResponse.model_validate(answer)

    def sync_weights(self, model) -> None:
        """Push ``model``'s weights (LoRA merged) to every server over the torch.distributed group."""
        self._push(model, None)

    def sync_weights_checked(self, model) -> SyncReport:
        """``sync_weights``, then each server compares what its engine holds with the sums of the bytes sent
        (``POST /check_weights/``, engines/sync_check/checksums.py); WeightSyncError naming server, bucket, tensor."""
        sums = SumsOf()
        sent = self._push(model, sums)
        if sent is None:  # not rank 0: rank 0 sent, and checks
            return SyncReport(here=False)
        post = lambda i, path, body: self._request(i, "POST", path, body)  # noqa: E731
        return check_servers(post, [e.label for e in self.endpoints], check_body(sent[0], sums.values()), sent[1])

    def _push(self, model, sums: SumsOf | None):
        if not sends_here(model):  # only rank 0 sends (another rank gathered its shards with it)
            return None
        infos = self._all_infos()
        if self._sender.interrupt:
            check_partial_rollouts(infos)
        dtypes = {info.get("torch_dtype") for info in infos}
        wire = parse_dtype(dtypes.pop()) if len(dtypes) == 1 and None not in dtypes else None
        t0 = time.perf_counter()
        adapter = self._adapter_update(model, infos)
        self._synced_version = None  # until the sync is in: a request naming the version being replaced may fail
        sent = self._sender.sync_summed(
            model,
            wire_dtype=wire,
            backend=self._backend(model),
            sums=sums,
            version=self.policy_version,
            adapter=adapter,
        )
        # the servers keep this LoRA version under the trainer's number: rollouts from now on ask for it
        self._synced_version = self.policy_version if adapter is not None else None
        self.last_sync_bytes = sum(b.nbytes for b in sent[0])  # bench/bench_lora_sync.py reads it
        logger.debug(
            "weight sync: %d bytes in %d buckets to %d server(s) in %.2fs",
            self.last_sync_bytes,
            len(sent[0]),
            len(self.endpoints),
            time.perf_counter() - t0,
        )
        return sent

    def _adapter_update(self, model, infos: list[dict]):
        """This sync's adapter-only update, or None (merged): every server must serve LoRA at the adapter's rank."""
        if self._adapters is None:
            return None
        ranks = [info.get("max_lora_rank") for info in infos]
        if not all(ranks):
            return self._adapters.update(model, "a rollout server runs without LoRA (--vllm_enable_lora false)")
        if min(ranks) < self._adapters.max_rank:
            self._adapters.max_rank = min(ranks)  # the servers' own --vllm_max_lora_rank bounds it
        return self._adapters.update(model)

    def reset_prefix_cache(self) -> None:
        for i in range(len(self.endpoints)):
            self._request(i, "POST", "/reset_prefix_cache/", {})

    def close(self) -> None:
        """Close the weight-sync group (on the servers too) and the HTTP connections. Idempotent."""
        super().close()
        try:
            self._sender.close(notify=True)
        finally:
            self._http.close()
            if self._claim is not None:
                self._claim.release()

    # -- helpers -------------------------------------------------------------------------------------------
    def _all_infos(self) -> list[dict]:
        self.engine_info()
        return self._infos

    def _backend(self, model) -> str:
        import torch

        on_gpu = next(model.parameters()).is_cuda
        servers_gpu = all(str(info.get("device", "cpu")).startswith("cuda") for info in self._all_infos())
        nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
        return "nccl" if on_gpu and servers_gpu and nccl else "gloo"
