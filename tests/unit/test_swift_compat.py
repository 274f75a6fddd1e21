"""ms-swift's reward-model plugin contract and the grpokit.swift import paths."""

from __future__ import annotations

import importlib
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from grpokit.errors import ConfigError
from grpokit.rewards import DefaultRMPlugin, RewardModelReward, RewardRunner, RMTemplate
from grpokit.rewards.rm_plugin import make_rm_plugin
from grpokit.testing import build_tiny_model

PROMPT = [{"role": "user", "content": "What is 7 + 5?"}]


def test_every_swift_import_of_the_ported_plugin_resolves(tmp_path):
    """The `from grpokit.swift.X import a, b` lines of the renamed swift-style plugin, checked name by name."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # conftest restores sys.path
    from third_party import swift_plugin

    text = swift_plugin(tmp_path / "plugin.py").read_text()
    lines = re.findall(r"from (grpokit\.swift[\w.]*) import ([\w, ]+)", text)
    assert len(lines) == 9
    for module, names in lines:
        mod = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(mod, name), f"{module}.{name}"


def test_rm_template_encodes_rows_and_collates_right_padded(tiny_rm):
    _, _, tokenizer = tiny_rm
    template = RMTemplate(tokenizer)
    short = template.encode({"messages": PROMPT + [{"role": "assistant", "content": "12"}], "solution": "12"})
    long = template.encode({"messages": PROMPT + [{"role": "assistant", "content": "12 " * 5}]})
    batch = template.data_collator([short, long])
    n = len(short["input_ids"])
    assert batch["input_ids"].shape == (2, len(long["input_ids"])) and n < len(long["input_ids"])
    assert batch["attention_mask"][0].tolist() == [1] * n + [0] * (len(long["input_ids"]) - n)
    assert batch["input_ids"][0, :n].tolist() == short["input_ids"]
    assert (batch["input_ids"][0, n:] == template.pad_token_id).all()


def test_swift_shaped_plugin_gets_rows_with_columns_and_may_return_a_tensor(tiny_rm):
    _, model, tokenizer = tiny_rm
    seen = {}

    class SwiftStyle:  # as ms-swift's CustomizedRMPlugin: encode + data_collator, a tensor back
        def __init__(self, model, template):
            self.model, self.template = model, template

        def __call__(self, inputs, **kwargs):
            seen["rows"], seen["kwargs"] = inputs, kwargs
            batch = self.template.data_collator([self.template.encode(row) for row in inputs])
            with torch.inference_mode():
                return self.model(**batch).logits[:, 0]

    reward = RewardModelReward(SwiftStyle(model, RMTemplate(tokenizer)), "rm")
    scores = RewardRunner([reward], ["rm"]).compute(
        ["12", "13"], {"messages": [PROMPT, PROMPT], "solution": ["12", "12"], "trainer_state": {"global_step": 4}}
    )
    assert all(math.isfinite(s) for s in scores[:, 0].tolist())
    rows = seen["rows"]
    assert [r["messages"][-1] for r in rows] == [
        {"role": "assistant", "content": "12"},
        {"role": "assistant", "content": "13"},
    ]
    assert [r["solution"] for r in rows] == ["12", "12"]
    assert seen["kwargs"]["trainer_state"].global_step == 4
    # the same scores from grpokit's DefaultRMPlugin, which follows the same contract
    default = RewardModelReward(DefaultRMPlugin(model, RMTemplate(tokenizer)), "d")
    assert default(["12", "13"], messages=[PROMPT, PROMPT]) == pytest.approx(scores[:, 0].tolist(), abs=1e-5)


def test_a_plugin_of_the_older_conversations_shape_still_works():
    class Old:
        def __call__(self, conversations):
            return [float(len(c)) for c in conversations]

    assert RewardModelReward(Old(), "old")(["a"], messages=[PROMPT]) == [2.0]


def test_make_rm_plugin_picks_the_model_class(tiny_rm, tmp_path):
    path, _, _ = tiny_rm
    causal_path = build_tiny_model(tmp_path / "causal")

    class Generates:
        def __init__(self, model, template):
            self.model, self.template = model, template

    assert type(make_rm_plugin(DefaultRMPlugin, str(path)).model).__name__.endswith("ForSequenceClassification")
    plugin = make_rm_plugin(Generates, str(causal_path))
    assert type(plugin.model).__name__.endswith("ForCausalLM") and isinstance(plugin.template, RMTemplate)

    class Broken:
        def __init__(self, model, template):
            raise KeyError("api_key")

    with pytest.raises(ConfigError, match="--reward_model_plugin Broken: could not be built: KeyError"):
        make_rm_plugin(Broken, str(path))


def test_swift_transformers_engine_takes_dict_requests(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.swift.infer_engine import RequestConfig, TransformersEngine, as_request
    from grpokit.swift.utils import to_device

    path = build_tiny_model(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(path)
    engine = TransformersEngine(model, template=RMTemplate(AutoTokenizer.from_pretrained(path)), max_batch_size=0)
    out = engine.infer(
        [{"messages": PROMPT, "solution": "12"}], RequestConfig(max_tokens=3, temperature=0), use_tqdm=False
    )
    assert len(out) == 1 and isinstance(out[0].choices[0].message.content, str)
    assert as_request({"messages": PROMPT, "x": 1}).data_dict == {"x": 1}
    with pytest.raises(ValueError, match="a dict with 'messages'"):
        as_request({"prompt": "hi"})
    with pytest.raises(ConfigError, match="pass a loaded model and its template"):
        TransformersEngine("Qwen/Qwen2.5-0.5B")
    moved = to_device({"a": [torch.zeros(1)], "b": (torch.ones(1),), "c": 3}, "cpu")
    assert moved["c"] == 3 and moved["a"][0].device.type == "cpu" and isinstance(moved["b"], tuple)
