"""A teacher on a `grpokit rollout` server: the log-probabilities of given tokens (``POST /score_tokens/``).

The trainer sends each sampled sequence as ids (prompt, completion: never re-tokenised) with the rollout's
temperature and kept set; the server answers one logprob per completion token, computed as the trainer computes
its own (trainers/packing.py's ``completion_logps``). The answer is checked before it is used: one finite value
≤ 0 per token asked, else a ServerError naming the server.
"""

from __future__ import annotations

import math
import os

import httpx

from grpokit.errors import ServerError

ROWS_PER_CALL = 64  # sequences per HTTP call: a bounded body each way


class TeacherServer:
    """``score`` posts to ``{url}/score_tokens/``; the API key is --vllm_server_api_key's environment variable
    (GRPOKIT_API_KEY), as for the rollout client."""

    def __init__(self, url: str, timeout: float = 240.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        api_key = api_key or os.environ.get("GRPOKIT_API_KEY") or None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=timeout)

    def score(
        self, prompts: list[list[int]], completions: list[list[int]], temperature: float, support: dict | None
    ) -> list[list[float]]:
        """One logprob per completion token of each (prompt, completion) pair, at ``temperature`` over the kept set
        ``support`` (RolloutBatch.sampler_support's fields, None: the full vocabulary)."""
        out: list[list[float]] = []
        for start in range(0, len(prompts), ROWS_PER_CALL):
            rows = range(start, min(start + ROWS_PER_CALL, len(prompts)))
            body = {
                "sequences": [{"prompt_ids": prompts[i], "completion_ids": completions[i]} for i in rows],
                "temperature": temperature,
                "support": support,
            }
            out += self._checked(self._post(body), [len(completions[i]) for i in rows])
        return out

    def _post(self, body: dict):
        try:
            r = self._http.post(f"{self.url}/score_tokens/", json=body)
        except httpx.HTTPError as e:
            raise ServerError(f"teacher server {self.url}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            detail = r.text[:300]
            hint = " (a `grpokit rollout` server of this version serves it)" if r.status_code == 404 else ""
            code = r.status_code
            raise ServerError(f"teacher server {self.url}: POST /score_tokens/ answered {code}{hint}: {detail}")
        try:
            return r.json()
        except ValueError:
            raise ServerError(f"teacher server {self.url}: /score_tokens/ answered no JSON") from None

    def _checked(self, answer, lengths: list[int]) -> list[list[float]]:
        rows = answer.get("logprobs") if isinstance(answer, dict) else None
        if not isinstance(rows, list) or len(rows) != len(lengths):
            raise ServerError(
                f'teacher server {self.url}: /score_tokens/ must answer {{"logprobs": [...]}} with {len(lengths)} rows'
            )
        for row, n in zip(rows, lengths, strict=True):
            if not isinstance(row, list) or len(row) != n or not all(_logprob(x) for x in row):
                raise ServerError(f"teacher server {self.url}: a row of /score_tokens/ is not {n} finite logprobs ≤ 0")
        return [[float(x) for x in row] for row in rows]

    def close(self) -> None:
        self._http.close()


def _logprob(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x <= 0.0
