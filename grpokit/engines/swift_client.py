"""Server mode against a server that speaks ms-swift's rollout protocol (``swift rollout``, or any server serving
its routes), detected at start-up by ``connect``: ``GET /get_engine_type/`` answers on ``grpokit rollout`` and is
405 on ``swift rollout``, whose ``POST /get_engine_type/`` answers ms-swift's four keys.

``SwiftRolloutClient`` is ``RolloutClient`` (same retries, timeouts, request splitting and ordering) with ms-swift's
bodies (grpokit/engines/swift_protocol.py) and ms-swift's weight design: the server hosts the group, the trainer
joins as its last rank (``GET /get_world_size/`` ranks on the server + 1) through the store at the server's host
and port ``51216 + i`` (ms-swift's default), then per bucket posts ``/update_flattened_params/`` and broadcasts,
then ``/process_weights_after_loading/`` and ``/reset_prefix_cache/``. gloo when the model is on the CPU, vLLM's
``PyNcclCommunicator`` on a GPU (grpokit/wire/swift_group.py).

What ms-swift's server does not report cannot be checked against the trainer's options: its scheduler's name,
``max_turns`` and gym environment are taken to be the trainer's (as ms-swift's trainer takes them), and
``--check_weight_sync`` is refused (it has no route that reads weights back).
"""

from __future__ import annotations

import logging
import time

import httpx
import torch

from grpokit.engines.client import RolloutClient
from grpokit.engines.client_transport import describe
from grpokit.engines.media_wire import request_to_wire
from grpokit.engines.swift_protocol import output_from_swift, swift_config, swift_request
from grpokit.engines.weight_sender import sends_here
from grpokit.engines.weights import iter_sync_weights
from grpokit.errors import ConfigError, ServerError
from grpokit.protocol import RolloutInferRequest
from grpokit.wire.swift_group import broadcast, open_group

logger = logging.getLogger(__name__)
GROUP_PORT = 51216  # ms-swift's VLLMClient: server i's group listens on 51216 + i
UNREPORTED = ("multi_turn_scheduler", "max_turns", "gym_env", "completion_length_limit_scope")


def speaks_swift(base_url: str, headers: dict, timeout: float) -> bool:
    """True when the server at ``base_url`` answers ms-swift's ``POST /get_engine_type/`` and not grpokit's GET."""
    with httpx.Client(headers=headers, timeout=timeout) as http:
        if http.get(base_url + "/get_engine_type/").status_code != 405:
            return False
        answer = http.post(base_url + "/get_engine_type/")
    if answer.status_code != 200:
        raise ServerError(f"rollout server {base_url}: POST /get_engine_type/ refused ({describe(answer)})")
    return "engine_type" in answer.json()


def connect(r, infer_on_loop_thread: bool = False) -> RolloutClient:
    """The client for ``RolloutArguments`` ``r``: grpokit's protocol, or ms-swift's when the first server speaks
    it (after waiting for it to answer /health/)."""
    client = RolloutClient.from_args(r, infer_on_loop_thread=infer_on_loop_thread)
    if not speaks_swift(client.endpoints[0].base_url, client._headers, client.timeout):
        return client
    client.close()
    logger.info("rollout server %s speaks ms-swift's protocol (swift rollout)", client.endpoints[0].label)
    return SwiftRolloutClient.from_args(r, infer_on_loop_thread=infer_on_loop_thread)


class SwiftRolloutClient(RolloutClient):
    """``RolloutClient`` over ms-swift's routes (module docstring)."""

    engine_type = "server"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._trainer_options: dict = {}  # the trainer's values of what ms-swift's server does not report
        self._comms: list = []

    @classmethod
    def from_args(cls, r, infer_on_loop_thread: bool = False) -> SwiftRolloutClient:
        if r.partial_rollouts:
            raise ConfigError(
                "--partial_rollouts true: a swift rollout server cannot pause generation for a weight "
                "update; use --partial_rollouts false"
            )
        client = super().from_args(r, infer_on_loop_thread=infer_on_loop_thread)
        client._trainer_options = {k: getattr(r, k, None) for k in UNREPORTED}
        return client

    # -- what the server reports ---------------------------------------------------------------------------
    def engine_info(self, refresh: bool = False) -> dict:
        if self._infos is None or refresh:
            self._infos = [self._swift_info(i) for i in range(len(self.endpoints))]
        return {**self._infos[0], "num_servers": len(self.endpoints)}

    def _swift_info(self, i: int) -> dict:
        answer = self._request(i, "POST", "/get_engine_type/")
        multi_turn = bool(answer.get("enable_multi_turn"))
        info = {
            "protocol": "ms-swift",
            "engine_type": f"swift {answer.get('engine_type')}",
            "model": self.endpoints[i].label,
            "enable_multi_turn": multi_turn,
            "use_gym_env": bool(answer.get("use_gym_env")),
            "uses_env_reward": bool(answer.get("use_gym_env")),
            "enable_lora": bool(answer.get("enable_lora")),
            "device": "unknown",
        }
        if multi_turn:  # not reported by ms-swift's server: the trainer's own values stand (ms-swift's rule)
            info.update({k: v for k, v in self._trainer_options.items() if v is not None})
        return info

    # -- rollouts ------------------------------------------------------------------------------------------
    def _wire(self, requests, config):
        return swift_config(config), [
            swift_request(RolloutInferRequest.model_validate(request_to_wire(r))) for r in requests
        ]

    def _infer_body(self, dumped, conf):
        return {
            "infer_requests": dumped,
            "request_config": conf,
            "metrics": None,
            "use_tqdm": None,
            "adapter_request": None,
        }

    def _outputs(self, answer, requests, idx, where):
        if not isinstance(answer, list) or len(answer) != len(idx):
            raise ServerError(
                f"{where} answered {len(idx)} requests with {type(answer).__name__} "
                f"of {len(answer) if isinstance(answer, list) else '?'} items"
            )
        return [output_from_swift(a, requests[j], where) for a, j in zip(answer, idx, strict=True)]

    def probe(self, request, config):
        raise ConfigError(
            "--check_weight_sync true: a swift rollout server has no route that reads its weights "
            "back; use --check_weight_sync false"
        )

    # -- weights -------------------------------------------------------------------------------------------
    def sync_weights_checked(self, model):
        return self.probe(None, None)

    def _push(self, model, sums):
        if sums is not None:
            self.probe(None, None)
        if not sends_here(model):
            return None
        on_gpu = next(model.parameters()).is_cuda
        if not self._comms:
            self._comms = [self._join(i, "nccl" if on_gpu else "gloo") for i in range(len(self.endpoints))]
        t0 = time.perf_counter()
        try:
            for metas, flat in self._buckets(model):
                for i, comm in enumerate(self._comms):
                    self._request(i, "POST", "/update_flattened_params/", {"metadatas": metas}, retries=0)
                    broadcast(comm, flat.to(comm.device), src=comm.rank)
            for i in range(len(self.endpoints)):
                self._request(i, "POST", "/process_weights_after_loading/", retries=0)
                self._request(i, "POST", "/reset_prefix_cache/", retries=0)
        except BaseException:
            self._drop_group(notify=False)
            raise
        logger.debug(
            "weight sync (ms-swift routes): %d server(s) in %.2fs", len(self.endpoints), time.perf_counter() - t0
        )
        return [], {}

    def _join(self, i: int, backend: str):
        world = int(self._request(i, "GET", "/get_world_size/")["world_size"])
        port = GROUP_PORT + i
        ep = self.endpoints[i]
        bind = "::" if ":" in ep.host else "0.0.0.0"
        self._request(
            i, "POST", "/init_communicator/", {"host": bind, "port": port, "world_size": world + 1}, retries=0
        )
        try:
            return open_group(ep.host, port, world, world + 1, backend, self.timeout)
        except RuntimeError as e:
            raise ServerError(f"rollout server {ep.label}: {e}") from e

    def _buckets(self, model):
        """(ms-swift's bucket metadata, flat uint8 tensor) of at most ``weight_sync_bucket_mb`` each (a larger
        tensor travels alone), in the model's own dtypes; LoRA merged."""
        limit = self._sender.bucket_bytes
        metas, parts, used = [], [], 0
        for name, tensor in iter_sync_weights(model, stable=True):
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            if parts and used + raw.numel() > limit:
                yield metas, torch.cat(parts)
                metas, parts, used = [], [], 0
            metas.append(
                {
                    "name": name,
                    "shape": list(tensor.shape),
                    "dtype": str(tensor.dtype),
                    "start_idx": used,
                    "end_idx": used + raw.numel(),
                    "numel": raw.numel(),
                }
            )
            parts.append(raw)
            used += raw.numel()
        if parts:
            yield metas, torch.cat(parts)

    def _drop_group(self, notify: bool = True) -> None:
        comms, self._comms = self._comms, []
        for i, comm in enumerate(comms):
            if notify:
                try:
                    self._request(i, "POST", "/close_communicator/", retries=0, timeout=10.0)
                except ServerError as e:
                    logger.warning("weight sync: could not close the group on a server: %s", e)
            if hasattr(comm, "close"):
                comm.close()

    def close(self) -> None:
        try:
            self._drop_group(notify=True)
        finally:
            super().close()
