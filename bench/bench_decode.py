"""Seconds of grpokit's decode loop (engines/fast_decode.py) on one GRPO rollout batch, against the loop as of a
git revision (its loop modules: the weights, the dense products, sampling), alternating in one process (a shared
machine's slow spells hit both) with the same seeds.

The batch is P prompts × G samples of the builtin arithmetic prompts, sampled at temperature 1. Both loops get
the same uniform draws, so they return the same tokens unless the float rounding of their products differs enough
to move a draw across a token boundary (said, and a repeat whose lengths then differ is left out). Reported: each
loop's median wall and CPU seconds and the ratios new / baseline per repeat (on a shared machine the CPU seconds
are the steadier).

    python bench/bench_decode.py --model smollm --threads 1 --baseline e8211f5 --repeats 3
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import resolve_model  # noqa: E402  (bench/ is no package)

LOOP_MODULES = ("decode_matmul", "decode_weights", "sampling", "fast_decode")  # the loop's own, in import order


def baseline_module(rev: str):
    """engines/fast_decode.py as of ``rev`` with the loop's modules of that revision (LOOP_MODULES, those it has),
    imported under other names; its other imports (prefix.py, errors) resolve to today's tree."""
    root = Path(__file__).resolve().parent.parent
    folder = Path(tempfile.mkdtemp())
    module = None
    for name in LOOP_MODULES:
        show = subprocess.run(
            ["git", "-C", str(root), "show", f"{rev}:grpokit/engines/{name}.py"], capture_output=True, text=True
        )
        if show.returncode:  # not in that revision
            continue
        text = show.stdout
        for other in LOOP_MODULES:
            text = text.replace(f"from grpokit.engines.{other} import", f"from baseline_{other} import")
        path = folder / f"baseline_{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def batch(a: argparse.Namespace):
    """The model, its template, and the left-padded prompt ids and mask [P·G, width]."""
    from grpokit.data.loading import load_dataset_spec, normalize_rows
    from grpokit.modeling import load_causal_lm, load_tokenizer
    from grpokit.template.encode import ChatTemplate

    path = resolve_model(a.model, Path(tempfile.mkdtemp()))
    model = load_causal_lm(path, torch.float32).eval()
    template = ChatTemplate(load_tokenizer(path))
    rows = normalize_rows(load_dataset_spec("builtin:arithmetic", seed=0), None)
    prompts = [template.encode_prompt(rows[i]["messages"]) for i in range(a.prompts) for _ in range(a.generations)]
    width = max(map(len, prompts))
    ids = torch.tensor([[template.pad_token_id] * (width - len(x)) + x for x in prompts])
    att = torch.arange(width) >= width - torch.tensor([len(x) for x in prompts])[:, None]  # left padding
    return model, template, ids, att.long()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm", help="tiny, smollm, or a model folder")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--baseline", default="e8211f5", help="git revision of the loop to compare with")
    p.add_argument("--keep_finished_rows", action="store_true", help="the new loop runs every row to the end")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from grpokit.engines import fast_decode

    if a.keep_finished_rows:
        fast_decode.DROP_SHARE = float("inf")
    model, template, ids, att = batch(a)
    pad = template.pad_token_id
    loops = {"baseline": baseline_module(a.baseline).FastDecoder, "new": fast_decode.FastDecoder}
    wall: dict[str, list[float]] = {k: [] for k in loops}
    cpu: dict[str, list[float]] = {k: [] for k in loops}
    for r in range(a.repeats):
        uniform = torch.rand(
            a.max_new_tokens, len(ids), 1, dtype=torch.float64, generator=torch.Generator().manual_seed(r)
        )
        out = {}
        for name, cls in sorted(loops.items(), reverse=r % 2 == 1):  # each goes first in every other repeat
            t0, c0 = time.perf_counter(), time.process_time()
            out[name], _ = cls(model).generate(
                ids,
                att,
                a.max_new_tokens,
                eos_token_id=template.eos_token_id,
                pad_token_id=pad,
                greedy=False,
                uniform=uniform,
            )
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
        lengths = {k: [(row != pad).sum().item() for row in v] for k, v in out.items()}
        print(
            f"repeat {r}: " + "  ".join(f"{k} {v[-1]:.2f} s" for k, v in wall.items()) + f"  lengths {lengths['new']}"
        )
        if not torch.equal(out["baseline"], out["new"]):  # the products' float rounding differs; so may a draw
            first = (out["baseline"] != out["new"]).any(0).nonzero()[0, 0].item()
            print(f"  tokens differ from new token {first} on; baseline lengths {lengths['baseline']}")
            if lengths["baseline"] != lengths["new"]:  # not the same work: left out of the ratios
                for seconds in (wall, cpu):
                    seconds["baseline"].pop(), seconds["new"].pop()
    print(f"model {a.model}: {len(ids)} rows, {a.max_new_tokens} new tokens, {a.threads} threads, {a.repeats} repeats")
    for label, seconds in (("wall", wall), ("CPU", cpu)):
        ratios = [n / b for n, b in zip(seconds["new"], seconds["baseline"], strict=True)]
        print(
            f"  {label:4s} s: baseline {statistics.median(seconds['baseline']):.2f}, new "
            f"{statistics.median(seconds['new']):.2f} (medians); new / baseline per repeat "
            f"{' '.join(f'{x:.3f}' for x in ratios)}, median {statistics.median(ratios):.3f}"
        )


if __name__ == "__main__":
    main()
