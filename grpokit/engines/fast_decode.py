"""A lean decode loop for Llama-family decoders, used by the transformers engine instead of HF ``generate``.

HF ``generate`` runs the model's general forward once per new token: attention-mask construction, a KV cache
that grows by one ``torch.cat`` per layer per token, module hooks and output objects. On a small model that
per-call work, not arithmetic, is the decode time (bench/bench_engine.py). This loop does the same arithmetic
in fewer operations:

- q/k/v and gate/up run as one matmul each (their weights concatenated once per call, LoRA updates added);
- the KV cache is preallocated and written in place; the rotary tables for every position are computed once,
  by the model's own rotary module (so its RoPE variant and scaling are the model's);
- each distinct prompt is prefilled once and its cache copied out to the rows that share it;
- a token is drawn by inverse CDF: one uniform number per row, not one per vocabulary entry.

The logits processors, stop-string criteria and sampling warpers are HF's own classes, applied in the order
``generate`` applies them, so the distribution sampled is ``generate``'s (tests compare logits and sampled
frequencies). Only the random stream differs.

Building a ``FastDecoder`` raises ``Unsupported`` (engines/decode_weights.py) for anything this loop does not
reproduce exactly, and the engine then uses HF ``generate``: another architecture, sliding-window attention, RoPE
tables that depend on the sequence length, quantised or sharded weights, adapters other than plain LoRA on linear
layers (DoRA, LoRA on the embedding, other peft tuners), or a model ``generation_config`` option not implemented
here. LoRA adapters are not merged into the model: their update is added as the fused weights are built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LogitsProcessorList, StoppingCriteriaList

from grpokit.engines.decode_weights import Layer, Norm, Unsupported, base_model, check_config, dense, norm, plain_weight
from grpokit.engines.prefix import shared_prompts
from grpokit.engines.sampling import check_finite_logits, inverse_cdf

CACHE_CHUNK = 256  # the KV cache grows by this many positions at a time
# finished rows are dropped from the KV cache once they are this share of its rows: with 8 rows or fewer, each
# finished row at once; with many, a drop every few finishes (not one whole-cache copy per finished row)
DROP_SHARE = 0.125


class FastDecoder:
    """The model's decoder stack as flat weights, read from the live parameters when built (build one per call:
    the weights change with every optimizer step and LoRA merge)."""

    @torch.no_grad()
    def __init__(self, model) -> None:
        model = base_model(model)
        check_config(model)
        cfg = model.config
        self.hidden = cfg.hidden_size
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.n_heads
        h, hd, nq, nkv = self.hidden, self.head_dim, self.n_heads, self.n_kv
        inner = model.model
        self.rotary = inner.rotary_emb
        self.embed = plain_weight(inner.embed_tokens, torch.nn.Embedding, (cfg.vocab_size, h), "embed_tokens")[0].weight
        self.final_norm = norm(inner.norm, h, "norm")
        self.lm_head = dense([model.lm_head], [(cfg.vocab_size, h)], "lm_head")
        act = F.silu if cfg.hidden_act in ("silu", "swish") else inner.layers[0].mlp.act_fn
        self.layers = [self._layer(i, layer, h, hd, nq, nkv, act) for i, layer in enumerate(inner.layers)]
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        devices = {self.device, self.lm_head.weight.device, self.final_norm.weight.device}
        devices.update(
            t.device
            for x in self.layers
            for t in (
                x.attn_norm.weight,
                x.qkv.weight,
                x.out.weight,
                x.mlp_norm.weight,
                x.gate_up.weight,
                x.down.weight,
            )
        )
        if len(devices) != 1 or self.device.type == "meta":
            raise Unsupported(f"weights on devices {sorted(map(str, devices))} (device_map or offloading)")
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []

    @staticmethod
    def _layer(i: int, layer, h: int, hd: int, nq: int, nkv: int, act) -> Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qk_norm = None
        if hasattr(attn, "q_norm"):
            qn, kn = norm(attn.q_norm, hd, f"layers.{i}.q_norm"), norm(attn.k_norm, hd, f"layers.{i}.k_norm")
            if qn.eps != kn.eps:
                raise Unsupported(f"layers.{i}: q_norm and k_norm with different eps")
            qk_norm = Norm(torch.cat([qn.weight.expand(nq, hd), kn.weight.expand(nkv, hd)]), qn.eps)
        inter = (getattr(mlp.down_proj, "base_layer", None) or mlp.down_proj).in_features
        return Layer(
            attn_norm=norm(layer.input_layernorm, h, f"layers.{i}.input_layernorm"),
            qkv=dense(
                [attn.q_proj, attn.k_proj, attn.v_proj],
                [(nq * hd, h), (nkv * hd, h), (nkv * hd, h)],
                f"layers.{i}.self_attn",
            ),
            qk_norm=qk_norm,
            scaling=float(getattr(attn, "scaling", hd**-0.5)),
            out=dense([attn.o_proj], [(h, nq * hd)], f"layers.{i}.o_proj"),
            mlp_norm=norm(layer.post_attention_layernorm, h, f"layers.{i}.post_attention_layernorm"),
            gate_up=dense([mlp.gate_proj, mlp.up_proj], [(inter, h), (inter, h)], f"layers.{i}.mlp"),
            act=act,
            down=dense([mlp.down_proj], [(h, inter)], f"layers.{i}.down_proj"),
        )

    # ------------------------------------------------------------------------------------------------------
    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and a sign-folded sin, [B, L, 1, head_dim], so that rope(x) = x·cos + roll(x, half)·sin."""
        cos, sin = self.rotary(self.embed, positions)
        half = self.head_dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return cos[:, :, None], sin[:, :, None]

    def _reserve(self, rows: int, length: int) -> None:
        """KV cache room for ``length`` positions (first exactly, then grown in CACHE_CHUNK steps, keeping what is
        written)."""
        have = self.k_cache[0].shape[2] if self.k_cache else 0
        if have >= length:
            return
        size = max(length, have + CACHE_CHUNK) if have else length
        shape = (rows, self.n_kv, size, self.head_dim)
        for caches in (self.k_cache, self.v_cache):
            for i in range(len(self.layers)):
                new = torch.empty(shape, dtype=self.dtype, device=self.device)
                if have:
                    new[:, :, :have] = caches[i]
                    caches[i] = new
                else:
                    caches.append(new)

    def _forward(
        self,
        x: torch.Tensor,
        start: int,
        mask: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> torch.Tensor:
        """Hidden states [B, n, H] after the decoder stack, for tokens at cache positions start..start+n-1."""
        b, n, _ = x.shape
        nq, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        end = start + n
        for layer, kc, vc in zip(self.layers, k_cache, v_cache, strict=True):
            qkv = layer.qkv(layer.attn_norm(x)).view(b, n, nq + 2 * nkv, hd)
            qk, v = qkv.split([nq + nkv, nkv], dim=2)
            if layer.qk_norm is not None:
                qk = layer.qk_norm(qk)
            qk = torch.addcmul(qk * cos, qk.roll(hd // 2, dims=-1), sin).transpose(1, 2)
            kc[:, :, start:end] = qk[:, nq:]
            vc[:, :, start:end] = v.transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qk[:, :nq], kc[:, :, :end], vc[:, :, :end], attn_mask=mask, scale=layer.scaling, enable_gqa=nq != nkv
            )
            x = x + layer.out(o.transpose(1, 2).reshape(b, n, nq * hd))
            gate, up = layer.gate_up(layer.mlp_norm(x)).chunk(2, dim=-1)
            x = x + layer.down(layer.act(gate) * up)
        return x

    def _logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_norm(hidden_last)).float()

    def _prefill(
        self, input_ids: torch.Tensor, key_valid: torch.Tensor, positions: torch.Tensor, total: int
    ) -> torch.Tensor:
        """Run the prompts; fill the cache of every row (none when ``total`` leaves no decode step); logits of each
        row's last prompt token [B, V]. Rows with the same prompt (a group's num_generations copies) run once, and
        their rope tables are built once."""
        b, p = input_ids.shape
        plan = shared_prompts(input_ids, 0)  # (first row of each distinct prompt, row → prompt), or None
        shared = plan is not None
        first, inverse = plan if shared else (None, None)
        rows = first if shared else slice(None)
        ids, valid = input_ids[rows], key_valid[rows]
        r = ids.shape[0]
        causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril()
        # padding queries (left of a shorter prompt) attend to themselves only: finite, and never read
        mask = (causal & valid[:, None, :]) | torch.eye(p, dtype=torch.bool, device=ids.device)
        shape = (r, self.n_kv, p, self.head_dim)
        k_tmp = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        v_tmp = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        cos, sin = self._rope_tables(positions[rows])
        hidden = self._forward(F.embedding(ids, self.embed), 0, mask[:, None], cos, sin, k_tmp, v_tmp)
        logits = self._logits(hidden[:, -1])
        self.k_cache, self.v_cache = [], []
        if total <= p + 1:  # one new token: sampled from these logits, no decode step reads a cache
            return logits[inverse] if shared else logits
        self._reserve(b, min(total, p + CACHE_CHUNK))
        for dst, src in zip(self.k_cache + self.v_cache, k_tmp + v_tmp, strict=True):
            dst[:, :, :p] = src[inverse] if shared else src
        return logits[inverse] if shared else logits

    def _next_logits(self, tok: torch.Tensor, cur: int, key_valid: torch.Tensor, positions: torch.Tensor):
        """The logits after token ``tok`` [B] is written at position ``cur`` (its keys and values cached)."""
        self._reserve(len(tok), cur + 1)
        cos, sin = self._rope_tables(positions[:, cur : cur + 1])
        mask = key_valid[:, None, None, : cur + 1]
        hidden = self._forward(F.embedding(tok[:, None], self.embed), cur, mask, cos, sin, self.k_cache, self.v_cache)
        return self._logits(hidden[:, -1])

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        *,
        eos_token_id: int,
        pad_token_id: int,
        greedy: bool,
        processors: LogitsProcessorList | None = None,
        stopping: StoppingCriteriaList | None = None,
        want_logprobs: bool = False,
        uniform: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """New tokens [B, T'] (pad after a row finishes; T' < max_new_tokens when every row stopped early) and,
        with ``want_logprobs``, each token's log-probability under the processed distribution [B, T'] (0 after a
        row finishes). ``input_ids`` are left-padded prompts; ``processors`` act as in HF ``generate`` (warpers
        included). ``uniform`` [T, B, 1] float64: the draws to sample with (a paused row's rest of its stream),
        else new."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        b, p = input_ids.shape
        t_max = max_new_tokens
        dev = input_ids.device
        key_valid = torch.cat([attention_mask.bool(), torch.ones(b, t_max, dtype=torch.bool, device=dev)], dim=1)
        # rope tables are built per step: all at once they would be rows × context × head_dim floats, twice
        positions = (key_valid.long().cumsum(-1) - 1).clamp(min=0)
        seqs = torch.cat([input_ids, input_ids.new_full((b, t_max), pad_token_id)], dim=1)  # what processors see
        if uniform is None and not greedy:
            uniform = torch.rand(t_max, b, 1, device=dev, dtype=torch.float64)
        try:
            logits = self._prefill(input_ids, key_valid[:, :p], positions[:, :p], p + t_max)
            live = _Rows(key_valid, positions)
            unfinished = torch.ones(b, dtype=torch.bool, device=dev)
            tokens, logprobs = [], []
            for t in range(t_max):
                cur = p + t
                scores = live.whole(logits)
                scores = processors(seqs[:, :cur], scores) if processors else scores
                tok, lp = _choose(
                    live.take(scores), None if greedy else live.take(uniform[t]), t, live.index, want_logprobs
                )
                tok = torch.where(unfinished, live.spread(tok, pad_token_id), pad_token_id)
                if want_logprobs:
                    logprobs.append(torch.where(unfinished, live.spread(lp, 0.0), 0.0))
                seqs[:, cur] = tok
                tokens.append(tok)
                unfinished &= tok != eos_token_id
                if stopping:
                    unfinished &= ~stopping(seqs[:, : cur + 1], scores)
                if t == t_max - 1 or not bool(unfinished.any()):
                    break
                if live.worth_dropping(unfinished):
                    self.k_cache, self.v_cache = live.drop_finished(unfinished, logits, self.k_cache, self.v_cache)
                logits = self._next_logits(live.take(tok), cur, live.key_valid, live.positions)
        finally:
            self.k_cache, self.v_cache = [], []
        new = torch.stack(tokens, dim=1)
        return new, (torch.stack(logprobs, dim=1) if want_logprobs else None)


class _Rows:
    """The batch rows the decode loop still runs the model for, once finished rows are dropped from the KV cache.

    A finished row's tokens are pad and its draws are discarded, so computing it is waste; once at least
    ``DROP_SHARE`` of the rows in the cache have finished, the cache (every layer's K and V, an index copy) and the
    rows' key mask and positions keep only the running rows. Everything outside the model keeps the whole batch in
    its order: the uniform draws are indexed by batch row, and processors and stopping criteria see [B, ...]
    tensors, a dropped row's scores being its last computed logits (finite, and its token is discarded as
    before). ``index``: the batch row of each cache row, None while the cache holds every row."""

    def __init__(self, key_valid: torch.Tensor, positions: torch.Tensor) -> None:
        self.index: torch.Tensor | None = None
        self.batch = len(key_valid)
        self.key_valid, self.positions = key_valid, positions
        self.scores: torch.Tensor | None = None  # [B, V]: the running rows' logits written in each step

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The running rows of a [B, ...] tensor."""
        return x if self.index is None else x.index_select(0, self.index)

    def spread(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        """[B] from the running rows' values, ``fill`` for the dropped rows."""
        if self.index is None:
            return x
        return x.new_full((self.batch,), fill).index_copy_(0, self.index, x)

    def whole(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] logits from the running rows' ``logits``."""
        if self.index is None:
            return logits
        return self.scores.index_copy_(0, self.index, logits)

    def worth_dropping(self, unfinished: torch.Tensor) -> bool:
        """Whether DROP_SHARE of the rows run have finished (copying the caches then costs less than running them:
        on CPU a row's cache copy is under a millisecond, a row's share of a SmolLM2 step several)."""
        running = self.take(unfinished)
        done = len(running) - int(running.sum())
        return done > 0 and done >= DROP_SHARE * len(running)

    def drop_finished(self, unfinished: torch.Tensor, logits: torch.Tensor, *caches: list[torch.Tensor]):
        """Keep only the unfinished rows; returns ``caches`` (lists of per-layer [rows, ...] tensors) cut to them.
        ``logits``: this step's, of the rows run (the first drop keeps them as the dropped rows' scores)."""
        keep = self.take(unfinished).nonzero()[:, 0]
        if self.index is None:
            self.scores = logits.clone()
        self.index = keep if self.index is None else self.index[keep]
        self.key_valid, self.positions = self.key_valid[keep], self.positions[keep]
        return tuple([c.index_select(0, keep) for c in cache] for cache in caches)


def _choose(
    scores: torch.Tensor, uniform: torch.Tensor | None, t: int, rows: torch.Tensor | None, want_logprobs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token of each row and, with ``want_logprobs``, its log-probability: the most likely (``uniform`` None:
    greedy), else drawn by inverse CDF with ``uniform`` [B, 1]. A row whose best score is -inf everywhere (all
    masked) or whose probabilities are NaN is refused (``rows``: the batch row of each row, for the error)."""
    if uniform is None:
        top, tok = scores.max(-1)
        check_finite_logits(top.float().clamp(min=torch.finfo(torch.float32).min), t, rows)  # -inf: masked
    else:
        tok = inverse_cdf(scores.softmax(-1), uniform, rows)  # refuses NaN probabilities
    lp = scores.log_softmax(-1).gather(1, tok[:, None])[:, 0] if want_logprobs else None
    return tok, lp
