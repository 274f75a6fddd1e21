"""LoRA weights merged for an engine from sharded models: 2 gloo processes wrap the same peft model with DeepSpeed
ZeRO-3 (partitioned) or FSDP2 (``--fsdp``'s sharding); ``iter_sync_weights`` on every rank gives exactly what
peft's ``merge_adapter`` writes on an unsharded copy, in ``named_sync_tensors``' order, and leaves the model as it
was."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from cli_process import run_grpokit_ranks

pytestmark = pytest.mark.slow
SCRIPT = r"""
import copy, json, os, sys
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM
from grpokit.engines.weights import iter_sync_weights, named_sync_tensors, plain_name

mode, out, dora = sys.argv[1], sys.argv[2], sys.argv[3] == "dora"
torch.manual_seed(0)
config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
model = get_peft_model(Qwen3ForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           use_rslora=True, use_dora=dora))
with torch.no_grad():
    for n, p in model.named_parameters():
        if "lora_B" in n or "lora_magnitude" in n:  # peft starts B at zero
            p.normal_(std=0.1)
reference = copy.deepcopy(model)
reference.merge_adapter()
want = {plain_name(n): p.detach() for n, p in reference.named_parameters() if plain_name(n) is not None}
if mode == "zero3":
    from grpokit.distributed.zero import ensure_process_group, initialize
    ensure_process_group(torch.device("cpu"))  # (its lease ends with this process)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 2,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    sharded = initialize(model, None, ds).module
else:
    import torch.distributed as dist
    from grpokit.distributed.sharding import shard_model
    dist.init_process_group("gloo")
    sharded = shard_model(model, torch.device("cpu"))
shard_shapes = {n: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
                for n, p in sharded.named_parameters()}
got = list(iter_sync_weights(sharded, stable=True))
again = dict(iter_sync_weights(sharded))  # the model was left as it was: the same weights a second time
result = {"names_in_order": [n for n, _ in got] == [n for n, _ in named_sync_tensors(sharded)],
          "keys_equal": {n for n, _ in got} == set(want),
          "max_diff": max(float((t - want[n]).abs().max()) for n, t in got),
          "again_diff": max(float((again[n] - t).abs().max()) for n, t in got),
          "sharded": any(s != tuple(want.get(plain_name(n) or "", torch.empty(0)).shape)
                         for n, s in shard_shapes.items() if plain_name(n) in want)}
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(result, f)
import torch.distributed as dist
from grpokit.distributed.processes import exit_if_groups_linger
dist.barrier()
dist.destroy_process_group()
exit_if_groups_linger(0)  # a gloo group torch still holds would abort the exit (docs/distributed.md, "A clean exit")
"""


@pytest.mark.parametrize(("mode", "kind"), [("zero3", "lora"), ("fsdp", "lora"), ("zero3", "dora")])
def test_lora_merged_from_shards_equals_peft_merge(tmp_path, mode, kind):
    """DoRA goes through peft's merge of each layer, in ZeRO-3's gathered copy (left behind with the gather)."""
    if mode == "zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed extra (pip install 'grpokit[deepspeed]')")
    script = tmp_path / "check.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # `torchrun --nproc_per_node 2 check.py MODE TMP KIND`: its ranks, forked from the test zygote (cli_process.py)
    proc = run_grpokit_ranks([mode, str(tmp_path), kind], 2, env=env, timeout=240, script=str(script))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {
            "names_in_order": True,
            "keys_equal": True,
            "max_diff": 0.0,
            "again_diff": 0.0,
            "sharded": True,
        }, (rank, result)
