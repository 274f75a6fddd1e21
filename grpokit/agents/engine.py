"""The engine behind an episode's calls: the trainer's transformers engine, sampling on the prompt ids the episode
planned (``Episode.plan``: an earlier prompt + its sampled ids + the template's tokens after them) instead of a
fresh rendering of the messages, which would re-tokenise the history the model wrote."""

from __future__ import annotations

from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.errors import ConfigError
from grpokit.protocol import RolloutInferRequest

PROMPT_IDS = "_grpokit_prompt_ids"  # data_dict key of a request's planned prompt ids (internal requests only)
CANCEL = "_grpokit_cancel"  # data_dict key of the episode's threading.Event: set, its calls stop at the next token


class EpisodeEngine(TransformersEngine):
    """Samples from the same model object as the engine it is made ``over`` (the live weights), on its own
    thread, so the endpoint's event loop keeps taking calls while a batch generates. An engine that says it takes
    planned prompt ids itself (``takes_prompt_ids``, e.g. a test's fake engine) is used as it is."""

    takes_prompt_ids = True

    @classmethod
    def over(cls, engine):
        if getattr(engine, "takes_prompt_ids", False):
            return engine
        if type(engine) is not TransformersEngine or getattr(engine.template, "multimodal", False):
            raise ConfigError(
                f"--agent with the {getattr(engine, 'engine_type', type(engine).__name__)} engine is "
                "not implemented (an episode's calls sample on planned prompt ids); use the "
                "in-process transformers engine with a text model"
            )
        new = cls(engine.model, engine.template, max_batch_size=engine.max_batch_size)
        new.fast_decode, new.share_prompts = engine.fast_decode, engine.share_prompts
        new._infer_thread()  # made here: it takes this thread's torch thread count (engines/base.py)
        return new

    def _encode(self, requests: list[RolloutInferRequest], max_tokens: int) -> list[list[int]]:
        given = [r.data_dict.get(PROMPT_IDS) for r in requests]
        rest = [r for r, g in zip(requests, given, strict=True) if g is None]
        rendered = iter(super()._encode(rest, max_tokens) if rest else [])
        return [list(g) if g is not None else next(rendered) for g in given]

    def cancel_events(self, requests: list[RolloutInferRequest]) -> list | None:
        events = [r.data_dict.get(CANCEL) for r in requests]
        return events if any(e is not None for e in events) else None
