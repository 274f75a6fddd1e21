"""Structured outputs on the transformers engine: a logits processor that keeps each row inside its grammar.

The constraint, its checks and the llguidance loader are in structured.py; here its compiled grammar is applied
token by token through llguidance's bitmask (``GrammarLogitsProcessor``), and ``StructuredOutputs`` is the engine's
``logits_processor_factory``, which compiles and caches a grammar per constraint.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from grpokit.engines.structured import (
    Constraint,
    check_constraint,
    constraint_from_config,
    first_error_line,
    llguidance_module,
    row_error,
)
from grpokit.errors import ConfigError, RolloutError

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept per engine


def allowed_from_bitmask(bitmask_BW: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool mask [B, vocab_size] from packed bits [B, W] (uint8, little-endian: bit j of byte k is token 8k+j).

    Tokens past the bitmask (a model vocabulary padded beyond the tokenizer's) are not allowed.
    """
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask_BW.device)
    bits = ((bitmask_BW.unsqueeze(-1) >> shifts) & 1).reshape(bitmask_BW.shape[0], -1).bool()  # [B, 8W]
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(bits.shape[0], vocab_size - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


class GrammarLogitsProcessor:
    """A Hugging Face logits processor: each row's next token must keep its completion inside the grammar.

    One llguidance matcher per row consumes the row's last sampled token, then the row's bitmask sets every
    disallowed logit to -inf. A row that produced EOS (or padding after a stop string) is left alone.
    Runs before temperature, top-k and top-p (generate() puts custom processors first), so the processed
    logprobs are those of the constrained distribution.

    A row whose matcher fails (the grammar engine's limits, or no continuation at all) is ended with EOS and its
    message kept in ``failed`` (row → one line); the other rows go on. The rollout server answers the request
    of a failed row with a 400 (server/engine.py); ``batch`` is the number of rows seen.
    """

    def __init__(
        self,
        lltokenizer,
        grammar: str,
        prompt_width: int,
        end_ids: set[int],
        eos_token_id: int,
        constraint: Constraint | None = None,
        limits=None,
    ) -> None:
        llg = llguidance_module()
        self._llg = llg
        self._root = llg.LLMatcher(lltokenizer, grammar, log_level=0, limits=limits)
        if self._root.is_error():
            raise ConfigError(f"structured outputs: {first_error_line(self._root.get_error())}")
        self.prompt_width = prompt_width
        self.end_ids = end_ids
        self.eos_token_id = eos_token_id
        self.constraint = constraint
        self.matchers: list = []
        self.done: list[bool] = []
        self.failed: dict[int, str] = {}
        self._masks: dict[int, bytes] = {}  # each row's last bitmask: was its sampled token allowed?

    @property
    def batch(self) -> int:
        return len(self.matchers)

    def __call__(self, input_ids_BL: torch.LongTensor, scores_BV: torch.FloatTensor) -> torch.FloatTensor:
        batch = scores_BV.shape[0]
        ended: list[int] = []  # rows failed at this step: EOS is their only token
        if not self.matchers:
            self.matchers = [self._root.deep_copy() for _ in range(batch)]
            self.done = [False] * batch
        elif input_ids_BL.shape[1] > self.prompt_width:
            last = input_ids_BL[:, -1].tolist()
            for row, token in enumerate(last):
                if not self._consume(row, token):
                    ended.append(row)
        rows, masks = [], []
        for r in range(batch):
            if self.done[r]:
                continue
            mask = self._bitmask(r)
            if mask is None:
                ended.append(r)
            else:
                rows.append(r)
                masks.append(mask)
        if ended:
            eos_only = torch.full_like(scores_BV[ended], float("-inf"))
            eos_only[:, self.eos_token_id] = 0.0
            scores_BV = scores_BV.index_copy(0, torch.tensor(ended, device=scores_BV.device), eos_only)
        if not rows:
            return scores_BV
        packed = torch.stack([torch.frombuffer(bytearray(m), dtype=torch.uint8) for m in masks])  # [R, W]
        allowed_RV = allowed_from_bitmask(packed, scores_BV.shape[1]).to(scores_BV.device)
        dead = ~allowed_RV.any(dim=1)  # the grammar allows no token here (e.g. the model's vocabulary cannot
        if bool(dead.any()):  # spell what it needs): end the row instead of sampling from nothing (NaN)
            allowed_RV[dead, self.eos_token_id] = True
        index = torch.tensor(rows, device=scores_BV.device)
        sub = scores_BV.index_select(0, index).masked_fill(~allowed_RV, float("-inf"))
        return scores_BV.index_copy(0, index, sub)

    def _fail(self, row: int, message: str) -> None:
        if not self.failed:
            logger.warning("structured outputs: row %d ended early: %s", row, message)
        self.failed[row] = message
        self.done[row] = True

    def _bitmask(self, row: int) -> bytes | None:
        m = self.matchers[row]
        try:
            mask = m.compute_bitmask()
        except Exception as e:  # noqa: BLE001 - llguidance may raise instead of flagging the matcher
            self._fail(row, row_error(self.constraint, str(e), "mask"))
            return None
        if m.is_error():
            self._fail(row, row_error(self.constraint, m.get_error(), "mask"))
            return None
        self._masks[row] = mask
        return mask

    def _consume(self, row: int, token: int) -> bool:
        """Advance the row's matcher by its sampled token; False (the row failed) when the matcher refuses it."""
        if self.done[row]:
            return True
        m = self.matchers[row]
        if token in self.end_ids:
            self.done[row] = True
            return True
        try:
            consumed = m.consume_token(token)
        except Exception as e:  # noqa: BLE001 - llguidance may raise instead of flagging the matcher
            self._fail(row, row_error(self.constraint, str(e), "token"))
            return False
        if not consumed:
            mask = self._masks.get(row, b"")
            if token // 8 >= len(mask) or not (mask[token // 8] >> (token % 8)) & 1:  # not from the grammar's mask:
                raise RolloutError(
                    f"structured outputs: the sampler picked token {token}, which the grammar "
                    f"refuses ({first_error_line(m.get_error())})"
                )  # a bug, not the request's
            self._fail(row, row_error(self.constraint, m.get_error(), "token"))  # the engine's own limits
            return False
        return True


class StructuredOutputs:
    """The transformers engine's ``logits_processor_factory``: ``factory(config, prompt_width)`` gives a
    ``LogitsProcessorList`` holding a ``GrammarLogitsProcessor`` when ``config`` carries a constraint, else None."""

    def __init__(self, tokenizer, eos_token_id: int, pad_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.end_ids = {eos_token_id} | ({pad_token_id} if pad_token_id is not None else set())
        self.eos_token_id = eos_token_id
        self._lltokenizer = None
        self._checked: OrderedDict[Constraint, str] = OrderedDict()  # constraint → compiled grammar (the latest few)
        self.limits = None  # llguidance's limits (None: its defaults); the rollout server sets request_limits()

    @property
    def lltokenizer(self):
        if self._lltokenizer is None:
            llguidance_module()
            import llguidance.hf

            try:
                self._lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=self.eos_token_id)
            except ValueError as e:
                raise ConfigError(f"structured outputs need a fast tokenizer (tokenizer.json): {e}") from e
        return self._lltokenizer

    def grammar_for(self, constraint: Constraint) -> str:
        """The checked grammar of ``constraint`` (compiled and validated once per constraint)."""
        grammar = self._checked.get(constraint)
        if grammar is None:
            check_constraint(constraint, self.lltokenizer, self.limits)
            grammar = self._checked[constraint] = constraint.grammar()
            while len(self._checked) > GRAMMAR_CACHE_SIZE:  # requests may each carry a new one: keep memory bounded
                self._checked.popitem(last=False)
        else:
            self._checked.move_to_end(constraint)
        return grammar

    def __call__(self, config, prompt_width: int):
        constraint = constraint_from_config(config)
        if constraint is None:
            return None
        from transformers import LogitsProcessorList

        grammar = self.grammar_for(constraint)
        return LogitsProcessorList(
            [
                GrammarLogitsProcessor(
                    self.lltokenizer, grammar, prompt_width, self.end_ids, self.eos_token_id, constraint, self.limits
                )
            ]
        )
