"""The plugin and helpers of bench/gpu_shard_check.sh (``--external_plugins``, and ``python bench/gpu_check_plugin.py
model DIR`` / ``report DIR NAME WALL``).

- ``token_sum``: a reward that varies within every group (a random model never answers right), so each step
  changes the weights.
- The trainer writes each rank's peak memory (``torch.cuda.max_memory_allocated``) to ``peak_rank<r>.json`` at the
  end of the run, and with vLLM colocate, after every weight sync, how far vLLM's embedding matrix is from the
  policy's (``vllm_sync.json``): 0 when the sync loaded the trained weights.
- ``model DIR``: a random Qwen3 with Qwen3-0.6B's body (hidden 1024, 28 layers, 16 heads, 8 KV heads, head dim
  128: ~0.44B parameters) and the tiny offline tokenizer (512 tokens), so no hub is needed; ``--tiny`` gives a
  2-layer one for the CPU dry run.
- ``report DIR NAME WALL``: one result line for a run's output folder; exit 1 when the run is not right.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from grpokit.rewards import ORM, orms
from grpokit.trainers.factory import TrainerFactory
from grpokit.trainers.grpo_trainer import GRPOTrainer


class TokenSum(ORM):
    def __call__(self, completions, completion_ids, **kwargs):
        return [float(sum(ids) % 11) / 11 for ids in completion_ids]


def _vllm_embedding(worker):
    """vLLM's embedding matrix, on the CPU in vLLM's dtype (runs inside vLLM's worker: ``collective_rpc``)."""
    for name, param in worker.model_runner.model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            return param.detach().cpu()
    raise RuntimeError("vLLM's model has no embed_tokens.weight")


class CheckedTrainer(GRPOTrainer):
    def _sync_weights(self) -> float:
        seconds = super()._sync_weights()  # the loop logs it as timing/sync
        if getattr(self.engine, "engine_type", "") != "vllm":
            return seconds
        ours = self.policy.get_input_embeddings().weight.detach().cpu().clone()  # (.cpu() of a CPU tensor: no copy)
        theirs = self.engine._run(self.engine.llm.collective_rpc, _vllm_embedding)[0][: ours.shape[0]]
        diff = float((ours.to(theirs.dtype).float() - theirs.float()).abs().max())  # as the sync casts them
        before = getattr(self, "_last_embedding", None)
        moved = float((ours.float() - before).abs().max()) if before is not None else None
        self._last_embedding = ours.float()
        self._sync_checks = [*getattr(self, "_sync_checks", []), {"diff": diff, "moved": moved}]
        return seconds

    def _finish(self) -> None:
        out = Path(self.args.output_dir)
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        (out / f"peak_rank{self.accelerator.process_index}.json").write_text(json.dumps({"peak_gib": peak}))
        if self.accelerator.is_main_process and hasattr(self, "_sync_checks"):
            (out / "vllm_sync.json").write_text(json.dumps(self._sync_checks))
        super()._finish()


orms["token_sum"] = TokenSum
TrainerFactory.TRAINER_MAPPING["grpo"] = f"{__name__}.CheckedTrainer"


def build_model(out: str, tiny: bool) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    from grpokit.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    hidden, layers, heads, kv, head_dim, inter = (64, 2, 4, 2, 32, 128) if tiny else (1024, 28, 16, 8, 128, 3072)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters in {out}")


def report(out: Path, name: str, wall: str) -> bool:
    """Print the run's result line; False when it did not train and save as it should."""
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    problems = [] if steps else ["no logged step"]
    timing = [sum(v for k, v in r.items() if k.startswith("timing/")) for r in steps]
    step_s = sum(timing[1:]) / len(timing[1:]) if len(timing) > 1 else (timing[0] if timing else 0.0)  # warm steps
    peaks = [json.loads(p.read_text())["peak_gib"] for p in sorted(out.glob("peak_rank*.json"))]
    final = out / "final_model"  # a full model folder, or a LoRA adapter folder
    if not ((final / "config.json").is_file() or (final / "adapter_config.json").is_file()):
        problems.append("no final_model")
    if any("grad_norm" not in r for r in steps):
        problems.append("a step logged no grad_norm")
    sync = out / "vllm_sync.json"
    extra = ""
    if sync.is_file():
        checks = json.loads(sync.read_text())
        extra = f", vLLM vs policy embedding max |diff| per sync {[c['diff'] for c in checks]}"
        if not checks or any(c["diff"] != 0.0 for c in checks):
            problems.append("vLLM's weights differ from the policy's after a sync")
        if not any(c["moved"] for c in checks):
            problems.append("the weights never moved between syncs")
    peak = "n/a (no CUDA)" if None in peaks or not peaks else f"{[round(p, 2) for p in peaks]} GiB"
    status = "FAIL" if problems else "PASS"
    print(
        f"RESULT {name} {status}: {len(steps)} steps, {step_s:.2f} s/step (after the first), peak torch GPU "
        f"memory per rank {peak}, {wall} s with start-up; grad_norm {[r.get('grad_norm') for r in steps]}"
        f"{extra}{'; ' + '; '.join(problems) if problems else ''}"
    )
    return not problems


if __name__ == "__main__":
    if sys.argv[1] == "model":
        build_model(sys.argv[2], tiny="--tiny" in sys.argv)
    elif sys.argv[1] == "report":
        sys.exit(0 if report(Path(sys.argv[2]), sys.argv[3], sys.argv[4]) else 1)
    else:
        sys.exit(f"usage: {os.path.basename(sys.argv[0])} model DIR [--tiny] | report DIR NAME WALL_S")
