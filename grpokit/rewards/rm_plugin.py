"""Reward models: a frozen classifier (``default``) or a generative judge (``genrm``), wrapped as a reward function.

The plugin contract is ms-swift's: ``rm_plugins[name](model, template)`` builds one (``template`` is an
``RMTemplate``: a chat template with ms-swift's ``encode(row)`` and ``data_collator(rows)``), and
``plugin(inputs=rows, **kwargs)`` scores rows, each a dict with the whole conversation in ``messages`` (the
completion last) and the dataset's columns; it returns one score per row (list or tensor; None = not scored).
``RewardModelReward`` adapts a plugin to the reward contract. The rewards layer does not build engines: for
``genrm`` the pipeline passes an engine with ``infer(requests, config)`` (``grpokit.engines``) serving the judge.
"""

from __future__ import annotations

import inspect
import logging
import re
import textwrap
from pathlib import Path
from typing import Any

from grpokit.errors import ConfigError, RewardError
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.registry import Registry
from grpokit.rewards.base import ORM
from grpokit.template.encode import ChatTemplate

logger = logging.getLogger(__name__)

rm_plugins: Registry = Registry("reward model plugin", "--reward_model_plugin")


def with_completion(messages: list[dict[str, Any]], completion: str) -> list[dict[str, Any]]:
    """The conversation ending in the completion: as given when it already ends with an assistant message."""
    msgs = [dict(m) for m in messages or []]
    if msgs and msgs[-1].get("role") == "assistant":
        return msgs
    return msgs + [{"role": "assistant", "content": completion}]


class RMTemplate(ChatTemplate):
    """The reward model's chat template, with ms-swift's ``encode(row)`` (the row's ``messages`` rendered whole
    and tokenized) and ``data_collator(encoded)`` (right-padded tensors, so a score does not depend on its
    batch-mates)."""

    def __init__(self, tokenizer: Any, max_length: int | None = None) -> None:
        super().__init__(tokenizer)
        self.max_length = max_length

    def encode(self, row: Any) -> dict[str, list[int]]:
        messages = row["messages"] if isinstance(row, dict) else getattr(row, "messages", row)
        ids = self.tokenize(self.tokenizer.apply_chat_template(list(messages), tokenize=False))
        return {"input_ids": ids[: self.max_length] if self.max_length else ids}

    def data_collator(self, batch: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        width = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, b in enumerate(batch):
            ids[i, : len(b["input_ids"])] = torch.tensor(b["input_ids"], dtype=torch.long)
            mask[i, : len(b["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask}


def row_messages(row: Any) -> list[dict[str, Any]]:
    """The conversation of one plugin input: a row's ``messages`` (a list of messages is taken as it is)."""
    return row["messages"] if isinstance(row, dict) else list(row)


class DefaultRMPlugin:
    """Scores conversations with a sequence-classification model: the first logit at the last token, in batches
    of ``batch_size`` without gradients. ``template``: an ``RMTemplate`` (a tokenizer is wrapped in one)."""

    def __init__(self, model: Any, template: Any, batch_size: int = 16, max_length: int | None = None) -> None:
        self.model = model
        self.template = template if isinstance(template, RMTemplate) else RMTemplate(template, max_length)
        self.tokenizer = self.template.tokenizer
        self.batch_size = batch_size
        if getattr(model.config, "pad_token_id", None) is None and self.tokenizer.pad_token_id is not None:
            model.config.pad_token_id = self.tokenizer.pad_token_id  # seq-cls models find the last token by pad id

    def __call__(self, inputs: list[Any], **kwargs: Any) -> list[float]:
        import torch

        encoded = [self.template.encode({"messages": row_messages(row)}) for row in inputs]
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(encoded), self.batch_size):
            batch = self.template.data_collator(encoded[start : start + self.batch_size])
            with torch.inference_mode():
                logits = self.model(**{k: v.to(device) for k, v in batch.items()}).logits  # [B, num_labels]
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
    return "\n".join(f"{str(m.get('role', '')).capitalize()}: {m['content']}" for m in messages if m.get("content"))


class GenRMPlugin:
    """A generative judge: asks ``engine`` to grade each conversation and parses a score from its reply.

    With ``n > 1`` in ``request_config`` the score is the mean over the parsable replies. A conversation with no
    parsable reply scores 0 (ms-swift's rule), with a warning and the count in ``last_metrics['unscored']``
    (logged as ``rewards/<name>/unscored``), so a broken judge prompt shows in the logs.
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
        self.unscored = 0  # rows whose judge reply held no score (scored 0)
        self.last_metrics: dict[str, float] = {}

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

    def __call__(self, inputs: list[Any], **kwargs: Any) -> list[float]:
        """One score per row; a row whose judge replies hold no score gets 0 (as in ms-swift), counted in
        ``unscored`` (and ``last_metrics['unscored']``) with a warning."""
        conversations = [row_messages(row) for row in inputs]
        responses = self.engine.infer(self.requests(conversations), self.request_config)
        if len(responses) != len(conversations):
            raise RewardError(f"genrm: the judge engine returned {len(responses)} replies for {len(conversations)}")
        scores, missing = [], 0
        for i, response in enumerate(responses):
            replies = [str(c.message.content or "") for c in response.choices]
            parsed = [s for s in (parse_judge_score(r) for r in replies) if s is not None]
            if not parsed:
                missing += 1
                if missing == 1:
                    logger.warning(
                        "genrm: no score in the judge's reply for sample %d (…%r); scored 0. The judge "
                        "must end with <score>x</score> or 'Score: a/b'",
                        i,
                        (replies or [""])[0][-80:],
                    )
                scores.append(0.0)
                continue
            scores.append(sum(parsed) / len(parsed))
        self.unscored += missing
        self.last_metrics = {"unscored": missing}
        return scores


def _takes_rows(plugin: Any) -> bool:
    """ms-swift's contract (``__call__(self, inputs, **kwargs)``) or the older ``__call__(conversations)``."""
    try:
        params = inspect.signature(plugin).parameters
    except (TypeError, ValueError):
        return True
    return "inputs" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


class RewardModelReward(ORM):
    """A reward-model plugin as a reward function: each sample becomes a row (its dataset columns and the whole
    conversation in ``messages``), and the plugin is called ``plugin(inputs=rows, trainer_state=...)``."""

    in_process = True  # its model lives in the trainer: --reward_timeout watches it from a thread (runner.py)

    def __init__(self, plugin: Any, name: str = "reward_model") -> None:
        super().__init__()
        self.plugin = plugin
        self.__name__ = name
        self._rows = _takes_rows(plugin)

    @property
    def last_metrics(self) -> dict[str, float]:
        return getattr(self.plugin, "last_metrics", None) or {}

    def __call__(self, completions: list[str], messages: list[Any], **kwargs: Any) -> list[float | None]:
        n = len(completions)
        conversations = [with_completion(m, c) for m, c in zip(messages, completions, strict=True)]
        if not self._rows:
            return list(self.plugin(conversations))
        columns = {k: v for k, v in kwargs.items() if isinstance(v, list) and len(v) == n and k != "prompts"}
        rows = [{**{k: v[i] for k, v in columns.items()}, "messages": conversations[i]} for i in range(n)]
        out = self.plugin(inputs=rows, trainer_state=kwargs.get("trainer_state"))
        if hasattr(out, "tolist"):
            out = out.tolist()  # a tensor [N], as ms-swift's plugins return
        return [None if s is None else float(s) for s in out]


def load_reward_model(path: str, torch_dtype: Any = None, device: Any = None, causal: bool = False) -> tuple[Any, Any]:
    """Load a frozen reward model and its tokenizer from a local directory or hub id: a sequence classifier, or
    with ``causal`` a causal LM (for plugins that generate, like ms-swift's generative judges)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    local = Path(path).expanduser()
    looks_like_hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) is not None and not str(path).startswith(".")
    if not local.exists() and not looks_like_hub_id:
        raise ConfigError(f"--reward_model {path}: not found; give a model directory saved with save_pretrained")
    source = str(local) if local.exists() else str(path)
    dtype = torch_dtype
    if isinstance(dtype, str) and dtype != "auto":
        import torch

        dtype = getattr(torch, dtype)
    auto = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = auto.from_pretrained(source, dtype=dtype)
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


def _is_classifier(path: str) -> bool:
    """The checkpoint's config names a *ForSequenceClassification architecture."""
    from transformers import AutoConfig

    try:
        archs = (
            AutoConfig.from_pretrained(
                str(Path(path).expanduser()) if Path(path).expanduser().exists() else path
            ).architectures
            or []
        )
    except OSError:
        return True  # load_reward_model reports the missing model
    return any(a.endswith("ForSequenceClassification") for a in archs)


def make_rm_plugin(plugin_cls: Any, path: str, torch_dtype: Any = None, device: Any = None) -> Any:
    """``plugin_cls(model, RMTemplate(tokenizer))`` as in ms-swift. The model is a sequence classifier for
    grpokit's ``DefaultRMPlugin`` or when the checkpoint is one; otherwise a causal LM (a plugin that generates,
    e.g. ms-swift's ``QwenLongPlugin``)."""
    causal = plugin_cls is not DefaultRMPlugin and not _is_classifier(path)
    model, tokenizer = load_reward_model(path, torch_dtype=torch_dtype, device=device, causal=causal)
    try:
        return plugin_cls(model, RMTemplate(tokenizer))
    except (ConfigError, RewardError):
        raise
    except Exception as exc:
        raise ConfigError(
            f"--reward_model_plugin {getattr(plugin_cls, '__name__', plugin_cls)}: could not be "
            f"built: {type(exc).__name__}: {exc}"
        ) from exc


def build_reward_model_reward(
    path: str, plugin: str = "default", torch_dtype: Any = None, device: Any = None, name: str | None = None
) -> RewardModelReward:
    """Load the model at ``path`` and wrap ``rm_plugins[plugin](model, template)`` as a reward function."""
    plugin_obj = make_rm_plugin(rm_plugins.get_or_raise(plugin), path, torch_dtype=torch_dtype, device=device)
    return RewardModelReward(plugin_obj, name or f"rm:{Path(path).name}")


rm_plugins["default"] = DefaultRMPlugin
rm_plugins["genrm"] = GenRMPlugin
