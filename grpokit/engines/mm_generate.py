"""Sampling from a vision-language model: HF ``generate`` with the processor's image tensors.

The prompt ids and tensors come from the template's processor (``ProcessorTemplate.encode_mm``) and are batched
by ``collate_mm``, the same function that builds the training forward's inputs. Every special token except
end-of-sequence is suppressed (an image token in a completion would make the training forward look for an image
that is not there). A token's logprob is the text paths' (docs/algorithms.md, "What a sampled token's logprob
is"): the log-softmax of the scores it was sampled from, after the suppression, the temperature, top-k and
top-p, i.e. renormalised over the kept set; the trainer rebuilds the same set (algorithms/kept_set.py).
"""

from __future__ import annotations

import torch

from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RequestConfig, RolloutInferRequest
from grpokit.template.processor import MMRow, collate_mm


def infer_mm(
    model, template, requests: list[RolloutInferRequest], config: RequestConfig, max_batch_size: int, structured=None
) -> list[ChatCompletionResponse]:
    """One response with ``config.n`` choices per request, the images taken from ``data_dict["images"]``.
    ``structured(config, prompt_width)``: the engine's structured-output logits processors, or None."""
    prompts = [template.encode_request(r) for r in requests]  # a later turn's prompt: the trajectory's own ids
    flat = [p for p in prompts for _ in range(config.n)]
    choices: list[ChatCompletionResponseChoice] = []
    if config.seed is not None:
        torch.manual_seed(config.seed)
    for start in range(0, len(flat), max_batch_size):
        choices.extend(_generate(model, template, flat[start : start + max_batch_size], config, structured))
    out = []
    for i, (ids, _) in enumerate(prompts):
        group = choices[i * config.n : (i + 1) * config.n]
        for k, c in enumerate(group):
            c.index = k
        out.append(ChatCompletionResponse(choices=group, prompt_token_ids=ids))
    return out


@torch.no_grad()
def _generate(model, template, prompts: list[tuple[list[int], MMRow]], config: RequestConfig, structured):
    from transformers import StoppingCriteriaList, StopStringCriteria

    device = next(model.parameters()).device
    pad, eos = template.pad_token_id, template.eos_token_id
    lengths = [len(ids) for ids, _ in prompts]
    width = max(lengths)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in prompts], dtype=torch.long)
    attention = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()  # left padding
    mm = {k: v.to(device) for k, v in collate_mm([row for _, row in prompts], width).items()}
    if "pixel_values" in mm:
        mm["pixel_values"] = mm["pixel_values"].to(next(model.parameters()).dtype)
    greedy = config.temperature == 0
    kwargs = dict(
        max_new_tokens=config.max_tokens,
        do_sample=not greedy,
        pad_token_id=pad,
        eos_token_id=eos,
        use_cache=True,
        return_dict_in_generate=True,
        output_scores=config.logprobs,
        repetition_penalty=config.repetition_penalty,
        suppress_tokens=template.blocked_token_ids or None,
    )
    if greedy:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(temperature=config.temperature, top_p=config.top_p, top_k=max(config.top_k, 0))
    processors = structured(config, width) if structured is not None else None
    if processors is not None:  # --structured_outputs_regex / _json, as on the text path
        kwargs["logits_processor"] = processors
    if config.stop:
        kwargs["stopping_criteria"] = StoppingCriteriaList([StopStringCriteria(template.tokenizer, config.stop)])
    was_training = model.training
    model.eval()
    try:
        gen = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device), **mm, **kwargs)
    finally:
        model.train(was_training)
    new = gen.sequences[:, width:]
    lps = None
    if config.logprobs:
        scores = torch.stack(gen.scores, dim=1).float()  # [B, T, V] processed: what each token was drawn from
        lps = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1).cpu().tolist()
    choices = []
    for r, row in enumerate(new.tolist()):
        ids, finish = _trim(row, eos, pad)
        text = template.tokenizer.decode(ids, skip_special_tokens=True)
        if finish == "length" and config.stop and any(text.endswith(s) for s in config.stop):
            finish = "stop"
        logprobs = None
        if lps is not None:
            logprobs = {"content": [{"token_id": t, "logprob": v} for t, v in zip(ids, lps[r])]}
        choices.append(
            ChatCompletionResponseChoice(
                message={"role": "assistant", "content": text}, finish_reason=finish, token_ids=ids, logprobs=logprobs
            )
        )
    return choices


def _trim(ids: list[int], eos: int, pad: int) -> tuple[list[int], str]:
    """A row's tokens up to its end (eos kept, padding dropped) and why it ended."""
    if eos in ids:
        return ids[: ids.index(eos) + 1], "stop"
    if pad != eos and pad in ids:  # finished early by a stop string; the rest is padding
        return ids[: ids.index(pad)], "stop"
    return ids, "length"
