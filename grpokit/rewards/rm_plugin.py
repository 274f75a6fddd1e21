"""Reward models: a frozen classifier (``default``) or a generative judge (``genrm``), wrapped as a reward function.

A plugin is called with full conversations (the completion is the last assistant message) and returns one float
per conversation. ``rm_plugins[name](model_or_engine, tokenizer)`` builds one; ``RewardModelReward`` adapts it to
the reward contract (``completions, messages``). The rewards layer does not build engines: for ``genrm`` the
pipeline passes an engine with ``infer(requests, config)`` (``grpokit.engines``) that serves the judge model; the
request types come from ``grpokit.protocol``.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

from grpokit.errors import ConfigError, RewardError
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.registry import Registry
from grpokit.rewards.base import ORM

rm_plugins: Registry = Registry("reward model plugin", "--reward_model_plugin")


def with_completion(messages: list[dict[str, Any]], completion: str) -> list[dict[str, Any]]:
    """The conversation ending in the completion: as given when it already ends with an assistant message."""
    msgs = [dict(m) for m in messages or []]
    if msgs and msgs[-1].get("role") == "assistant":
        return msgs
    return msgs + [{"role": "assistant", "content": completion}]


class DefaultRMPlugin:
    """Scores conversations with a sequence-classification model: the first logit at the last token.

    Conversations are rendered with the reward model's own chat template, right-padded (so a sample's score does
    not depend on its batch-mates) and run in batches of ``batch_size`` without gradients.
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 16, max_length: int | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        if getattr(model.config, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
            model.config.pad_token_id = tokenizer.pad_token_id  # batched seq-cls models find the last token by pad id

    def __call__(self, conversations: list[list[dict[str, Any]]]) -> list[float]:
        import torch

        texts = [self.tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                truncation=self.max_length is not None,
                max_length=self.max_length,
                add_special_tokens=False,
            ).to(device)
            with torch.inference_mode():
                logits = self.model(**batch).logits  # [B, num_labels]
            scores.extend(logits[:, 0].float().cpu().tolist())
        return scores


GENRM_SYSTEM = textwrap.dedent(
    """\
    You judge an assistant's last reply in a dialogue. Decide whether it is accurate, complete and relevant.
    Think briefly, then end with the score between 0 (completely wrong) and 1 (fully right) in this form:
    <score>0.85</score>"""
)
GENRM_PROMPT = "Dialogue:\n{conversation}\n\nJudge the assistant's last reply."
_SCORE_PATTERNS = (
    re.compile(r"<score>\s*([-+]?\d*\.?\d+)\s*</score>", re.IGNORECASE),
    re.compile(r"\b(?:score|reward)\s*[:=]\s*([-+]?\d*\.?\d+)\s*/\s*(\d*\.?\d+)", re.IGNORECASE),
    re.compile(r"\b(?:score|reward)\s*[:=]\s*([-+]?\d*\.?\d+)", re.IGNORECASE),
)


def parse_judge_score(reply: str) -> float | None:
    """The score in a judge's reply: ``<score>x</score>``, ``Score: a/b`` (→ a/b) or ``Score: x``; else None."""
    for pattern in _SCORE_PATTERNS:
        found = pattern.findall(reply)
        if found:
            last = found[-1]
            if isinstance(last, tuple):
                num, den = float(last[0]), float(last[1])
                return num / den if den else None
            return float(last)
    return None


def render_conversation(messages: list[dict[str, Any]]) -> str:
    """``Role: content`` lines, one per non-empty message."""
    return "\n".join(
        f"{str(m.get('role', '')).capitalize()}: {m['content']}" for m in messages if m.get("content")
    )


class GenRMPlugin:
    """A generative judge: asks ``engine`` to grade each conversation and parses a score from its reply.

    With ``n > 1`` in ``request_config`` the score is the mean over the parsable replies. A conversation with no
    parsable reply raises RewardError (a silently defaulted score would hide a broken judge prompt).
    ``tokenizer`` is used only to cut long conversations to their last ``max_conversation_tokens`` tokens.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any = None,
        prompt_template: str = GENRM_PROMPT,
        system: str = GENRM_SYSTEM,
        request_config: RequestConfig | None = None,
        max_conversation_tokens: int | None = None,
    ) -> None:
        if not callable(getattr(engine, "infer", None)):
            raise ConfigError(
                f"GenRMPlugin: got {type(engine).__name__}, which has no infer(requests, config); "
                "pass an inference engine serving the judge model"
            )
        if "{conversation}" not in prompt_template:
            raise ConfigError("GenRMPlugin prompt_template: must contain '{conversation}'")
        if max_conversation_tokens is not None and tokenizer is None:
            raise ConfigError("GenRMPlugin max_conversation_tokens: needs a tokenizer to count tokens")
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompt_template = prompt_template
        self.system = system
        if request_config is None:
            request_config = RequestConfig(temperature=0.0, max_tokens=512)
        self.request_config = request_config
        self.max_conversation_tokens = max_conversation_tokens

    def _conversation_text(self, messages: list[dict[str, Any]]) -> str:
        text = render_conversation(messages)
        if self.max_conversation_tokens is None:
            return text
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.max_conversation_tokens:
            return text
        return "…" + self.tokenizer.decode(ids[-self.max_conversation_tokens :])

    def requests(self, conversations: list[list[dict[str, Any]]]) -> list[RolloutInferRequest]:
        """One judge request per conversation."""
        out = []
        for messages in conversations:
            prompt = self.prompt_template.format(conversation=self._conversation_text(messages))
            msgs = ([{"role": "system", "content": self.system}] if self.system else []) + [
                {"role": "user", "content": prompt}
            ]
            out.append(RolloutInferRequest(messages=msgs))
        return out

    def __call__(self, conversations: list[list[dict[str, Any]]]) -> list[float]:
        responses = self.engine.infer(self.requests(conversations), self.request_config)
        if len(responses) != len(conversations):
            raise RewardError(f"genrm: the judge engine returned {len(responses)} replies for {len(conversations)}")
        scores = []
        for i, response in enumerate(responses):
            replies = [str(c.message.get("content") or "") for c in response.choices]
            parsed = [s for s in (parse_judge_score(r) for r in replies) if s is not None]
            if not parsed:
                preview = replies[0][-80:] if replies else ""
                raise RewardError(
                    f"genrm: no score in the judge's reply for sample {i} (…{preview!r}); "
                    "the judge must end with <score>x</score> or 'Score: a/b'"
                )
            scores.append(sum(parsed) / len(parsed))
        return scores


class RewardModelReward(ORM):
    """A reward-model plugin as a reward function over ``completions`` and ``messages``."""

    def __init__(self, plugin: Any, name: str = "reward_model") -> None:
        super().__init__()
        self.plugin = plugin
        self.__name__ = name

    def __call__(self, completions: list[str], messages: list[Any], **kwargs: Any) -> list[float | None]:
        conversations = [with_completion(m, c) for m, c in zip(messages, completions, strict=True)]
        return [float(s) for s in self.plugin(conversations)]


def load_reward_model(path: str, torch_dtype: Any = None, device: Any = None) -> tuple[Any, Any]:
    """Load a frozen sequence-classification reward model and its tokenizer from a local directory or hub id."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    local = Path(path).expanduser()
    looks_like_hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) is not None and not str(path).startswith(".")
    if not local.exists() and not looks_like_hub_id:
        raise ConfigError(f"--reward_model {path}: not found; give a model directory saved with save_pretrained")
    source = str(local) if local.exists() else str(path)
    dtype = torch_dtype
    if isinstance(dtype, str) and dtype != "auto":
        import torch

        dtype = getattr(torch, dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForSequenceClassification.from_pretrained(source, dtype=dtype)
    except OSError as exc:
        raise ConfigError(f"--reward_model {path}: not found or not a model ({str(exc).splitlines()[0]})") from exc
    if device is not None:
        model = model.to(device)
    model.requires_grad_(False).eval()
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batching needs a pad token; its value never reaches the score
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def build_reward_model_reward(
    path: str, plugin: str = "default", torch_dtype: Any = None, device: Any = None, name: str | None = None
) -> RewardModelReward:
    """Load the model at ``path`` and wrap ``rm_plugins[plugin](model, tokenizer)`` as a reward function."""
    model, tokenizer = load_reward_model(path, torch_dtype=torch_dtype, device=device)
    plugin_obj = rm_plugins.get_or_raise(plugin)(model, tokenizer)
    return RewardModelReward(plugin_obj, name or f"rm:{Path(path).name}")


rm_plugins["default"] = DefaultRMPlugin
rm_plugins["genrm"] = GenRMPlugin
