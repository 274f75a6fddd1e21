"""Rollout tokens per second: grpokit's TransformersEngine against raw HF ``generate`` on the same batch.

The batch is what a GRPO step generates: P prompts × G completions each. Raw HF ``generate`` gets the expanded,
left-padded batch (what a trainer built on it does); the engine gets the same requests. Greedy decoding makes both
produce the same tokens, so tokens/s compare like for like. Each variant runs R times, interleaved; medians.
The engine runs with its own decode loop (engines/fast_decode.py, the default) and on HF ``generate``.

    python bench/bench_engine.py --model smollm --prompts 2 --generations 8 --max_new_tokens 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, smollm, or a model folder")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    import tempfile
    from pathlib import Path

    from bench_step import resolve_model

    from grpokit.data.loading import load_dataset_spec, normalize_rows
    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.modeling import load_causal_lm, load_tokenizer
    from grpokit.protocol import RequestConfig, RolloutInferRequest
    from grpokit.template.encode import ChatTemplate

    path = resolve_model(a.model, Path(tempfile.mkdtemp()))
    model = load_causal_lm(path, torch.float32).eval()
    tok = load_tokenizer(path)
    template = ChatTemplate(tok)
    rows = normalize_rows(load_dataset_spec("builtin:arithmetic", seed=0), None)
    msgs = [rows[i]["messages"] for i in range(a.prompts)]
    requests = [RolloutInferRequest(messages=m) for m in msgs for _ in range(a.generations)]
    config = RequestConfig(max_tokens=a.max_new_tokens, temperature=0.0)
    texts = [template.render_prompt(r.messages) for r in requests]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    def raw() -> int:
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=a.max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=template.pad_token_id,
                eos_token_id=template.eos_token_id,
            )
        new = out[:, enc["input_ids"].shape[1] :]
        count = 0
        for row in new.tolist():
            count += row.index(template.eos_token_id) + 1 if template.eos_token_id in row else len(row)
        return count

    def engine(fast: bool, share: bool | None = None):
        eng = TransformersEngine(model, template)
        eng.fast_decode, eng.share_prompts = fast, share

        def run() -> int:
            return sum(len(r.choices[0].token_ids) for r in eng.infer(requests, config))

        return run

    variants = {
        "raw HF generate": raw,
        "grpokit engine (fast decode loop)": engine(True),
        "grpokit engine on HF generate": engine(False),
        "grpokit engine on HF generate, no sharing": engine(False, share=False),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    tokens: dict[str, int] = {}
    for _ in range(a.repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - t0)
    print(
        f"model {a.model}: {a.prompts} prompts × {a.generations} completions, ≤{a.max_new_tokens} new tokens, "
        f"greedy, {torch.get_num_threads()} threads, median of {a.repeats}"
    )
    base = tokens["raw HF generate"] / statistics.median(times["raw HF generate"])
    for name in variants:
        tps = tokens[name] / statistics.median(times[name])
        print(f"  {name:42s} {tokens[name]:5d} tokens  {tps:8.1f} tok/s  ({tps / base:.2f}× raw)")


if __name__ == "__main__":
    main()
