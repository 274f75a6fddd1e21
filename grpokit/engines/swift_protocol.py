"""Between ms-swift's rollout bodies (grpokit/wire/swift.py) and grpokit's protocol (grpokit/protocol.py), both ways:
the rollout server reads ms-swift's requests and answers in ms-swift's ``RolloutOutput`` shape; the trainer's client
of a ``swift rollout`` server sends ms-swift's requests and reads its answers.

What grpokit cannot do is refused by name (``SwiftRefused``, a 400 on the server): audio, video and ``objects``
inputs, ``add_eos`` (scoring a finished response), beam search, streaming, top/prompt logprobs, min_p and the
presence, frequency and length penalties at values other than their neutral ones, and more than one completion per
request (``n``; a GRPO group is sent as repeated requests, as ms-swift's trainer does). ``null`` is unset: grpokit's
default.
"""

from __future__ import annotations

import time
from typing import Any

from grpokit.errors import ServerError
from grpokit.protocol import RequestConfig, RolloutInferRequest, RolloutOutput, new_id
from grpokit.template.encode import attach, detach
from grpokit.wire.swift import SwiftInferRequest, SwiftRequestConfig

# ms-swift's sampling fields at the value that asks for nothing grpokit lacks: (neutral values, what to do instead)
_NEUTRAL = {
    "min_p": ((0.0,), "min-p sampling is not implemented; use top_p / top_k"),
    "num_beams": ((1,), "beam search is not implemented; sample (num_beams 1)"),
    "stream": ((False,), "the answer is one JSON list; streaming is not implemented"),
    "top_logprobs": ((0,), "only the sampled tokens' logprobs are returned (logprobs true)"),
    "prompt_logprobs": ((), "prompt logprobs are not returned; leave it null"),
    "n": ((1,), "one trajectory per request: repeat the request (ms-swift's trainer does) instead of n"),
    "presence_penalty": ((0.0,), "not implemented; use repetition_penalty"),
    "frequency_penalty": ((0.0,), "not implemented; use repetition_penalty"),
    "length_penalty": ((1.0,), "acts on beam search only, which is not implemented"),
}
_REPLY_KEYS = ("role", "content", "tool_calls", "reasoning_content")  # ms-swift's ChatMessage
_SAME = ("max_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "logprobs")


class SwiftRefused(ValueError):
    """A request field asking for what grpokit lacks; the message names the field (``where``)."""


def grpokit_config(config: SwiftRequestConfig | None, where: str = "request_config") -> RequestConfig:
    """ms-swift's ``RequestConfig`` as grpokit's; SwiftRefused naming the first field grpokit cannot honour."""
    if config is None:
        return RequestConfig()
    for name, (neutral, instead) in _NEUTRAL.items():
        value = getattr(config, name)
        if value is not None and value not in neutral:
            raise SwiftRefused(f"{where}.{name} {value!r}: {instead}")
    if config.best_of is not None and config.best_of != 1:
        raise SwiftRefused(f"{where}.best_of {config.best_of}: one completion per request; leave it null")
    fields = {name: getattr(config, name) for name in _SAME if getattr(config, name) is not None}
    if config.stop:
        fields["stop"] = config.stop
    if config.structured_outputs_regex is not None:
        fields["structured_outputs_regex"] = config.structured_outputs_regex
    try:
        return RequestConfig(**fields)
    except ValueError as e:  # a value grpokit's own bounds refuse (e.g. temperature 0.001)
        raise SwiftRefused(f"{where}: {str(e).splitlines()[-1].strip()}") from None


def grpokit_request(request: SwiftInferRequest, where: str) -> RolloutInferRequest:
    """ms-swift's ``RolloutInferRequest`` as grpokit's: ``uuid`` becomes the request id (the answer's
    ``response.id``), ``tools`` and ``chat_template_kwargs`` travel on the first message (template/encode.py)."""
    for name in ("audios", "videos"):
        if getattr(request, name):
            raise SwiftRefused(f"{where}.{name}: grpokit rollout serves text and images; send no {name}")
    if request.objects:
        raise SwiftRefused(f"{where}.objects: multimodal objects are not implemented; send images in 'images'")
    if request.add_eos is not None:
        raise SwiftRefused(
            f"{where}.add_eos {request.add_eos!r}: scoring a finished response is not implemented; "
            "leave it null to sample"
        )
    messages = attach(request.messages, tools=request.tools, kwargs=request.chat_template_kwargs)
    fields: dict[str, Any] = {"messages": messages, "data_dict": request.data_dict or {}}
    if request.images:
        fields["images"] = request.images
    if request.uuid is not None:
        fields["request_id"] = request.uuid
    try:
        return RolloutInferRequest(**fields)
    except ValueError as e:
        raise SwiftRefused(f"{where}: {str(e).splitlines()[-1].strip()}") from None


def _usage(prompt: list[int] | None, completion: list[int]) -> dict[str, int]:
    p, c = len(prompt or []), len(completion)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def swift_answer(wire: dict, model: str, multi_turn: bool) -> dict:
    """One trajectory (grpokit's answer, ``server.media.output_to_wire``) in the shape ms-swift's
    ``RolloutOutput.model_validate`` reads: ``response.id`` is the request's uuid, ``usage`` counts the prompt and
    the last turn's tokens. ``messages`` is null from a single-turn server (ms-swift's trainer then appends the
    reply itself) and the whole conversation from a multi-turn one, less the keys that carried tools and template
    arguments."""
    response = wire["response"]
    choice = response["choices"][-1]
    message = {
        k: v for k, v in choice["message"].items() if k in ("role", "content", "tool_calls", "reasoning_content")
    }
    return {
        "response": {
            "id": wire["request_id"],
            "model": model,
            "object": "chat.completion",
            "created": int(time.time()),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": choice["finish_reason"],
                    "logprobs": choice.get("logprobs"),
                    "token_ids": choice["token_ids"],
                }
            ],
            "usage": _usage(response.get("prompt_token_ids"), choice["token_ids"]),
            "prompt_token_ids": response.get("prompt_token_ids"),
        },
        "messages": detach(wire["messages"])[0] if multi_turn else None,
        "response_token_ids": wire["response_token_ids"],
        "response_loss_mask": wire["response_loss_mask"],
        "rollout_infos": wire["rollout_infos"],
        "rollout_logprobs": wire["rollout_logprobs"],
    }


# -- the trainer's side: grpokit's requests to a `swift rollout` server, and its answers back ------------------------
def swift_request(request: RolloutInferRequest) -> dict:
    """A grpokit request as ms-swift's ``RolloutInferRequest`` (its ``asdict`` form); images already on the wire."""
    messages, tools, kwargs = detach(request.messages)
    return {
        "messages": messages,
        "images": list(request.images),
        "audios": [],
        "videos": [],
        "tools": tools,
        "objects": {},
        "chat_template_kwargs": kwargs,
        "data_dict": request.data_dict,
        "uuid": request.request_id,
    }


def swift_config(config: RequestConfig) -> dict:
    """grpokit's sampling settings as ms-swift's ``RequestConfig`` (token ids and logprobs always asked for)."""
    if config.structured_outputs_json is not None:
        raise ServerError(
            "structured_outputs_json: a swift rollout server takes structured_outputs_regex only; use "
            "--structured_outputs_regex, or serve with grpokit rollout"
        )
    fields = config.model_dump(include={"max_tokens", "top_k", "top_p", "repetition_penalty", "stop", "seed", "n"})
    return {
        **fields,
        "temperature": config.temperature,
        "logprobs": True,
        "return_details": True,
        "structured_outputs_regex": config.structured_outputs_regex,
    }


def output_from_swift(answer: Any, request: RolloutInferRequest, where: str) -> RolloutOutput:
    """ms-swift's ``RolloutOutput`` answer as grpokit's. ``messages`` null (a single turn) is the request's
    messages plus the reply; ``response_token_ids`` empty is the reply's ``token_ids`` as one segment, all trained."""
    try:
        response = answer["response"]
        choice = response["choices"][-1]
        token_ids = choice.get("token_ids")
        if token_ids is None:
            raise ValueError("response.choices[-1].token_ids is null (the server was asked for return_details)")
        reply = {"role": "assistant", "content": choice["message"]["content"]}
        messages = answer.get("messages") or [*detach(request.messages)[0], reply]
        segments = answer.get("response_token_ids") or [token_ids]
        masks = answer.get("response_loss_mask") or [[1] * len(s) for s in segments]
        logprobs = answer.get("rollout_logprobs") or []
        if not logprobs and choice.get("logprobs") and len(segments) == 1:
            logprobs = [[float(item["logprob"]) for item in choice["logprobs"]["content"]]]
        return RolloutOutput.model_validate(
            {
                "response": {
                    "id": response.get("id") or new_id(),
                    "model": response.get("model") or "",
                    "choices": [{**choice, "index": 0, "message": reply, "token_ids": token_ids}],
                    "prompt_token_ids": response.get("prompt_token_ids"),
                },
                "messages": messages,
                "response_token_ids": segments,
                "response_loss_mask": masks,
                "rollout_infos": answer.get("rollout_infos") or {},
                "rollout_logprobs": logprobs,
                "request_id": request.request_id,
                "prompt_id": request.prompt_id,
            }
        )
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise ServerError(f"{where} answered /infer/ with an output grpokit cannot read ({str(e)[:200]})") from e
