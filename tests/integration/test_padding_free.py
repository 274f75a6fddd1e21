"""--padding_free: a micro-batch's rows packed into one row without padding (position_ids restarting per row)
give the padded forward's logps (float32, to 1e-5) and gradients, with sdpa and eager attention, with the plain
and the chunked head; training runs with it; attention that would mix packed rows is refused."""

from __future__ import annotations

import pytest
import torch
from support import flags, padded_batch

from grpokit.trainers.packing import ForwardOptions, check_packing, completion_logps, pack_rows

pytestmark = pytest.mark.slow

# A float32 sum in another order (a packed row of 30 tokens instead of 6 rows of 9) moves a gradient entry by
# about eps times its terms' magnitudes: bounded relative to the tensor's scale, as in test_prefix_sharing.
GRAD_RTOL = 5e-5


def _model(model_dir, attn: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    model.train()
    return model


def test_pack_rows_layout():
    inputs, c = padded_batch(50)
    packed = pack_rows(inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"], c)
    lengths = inputs["attention_mask"].sum(1).tolist()  # [9, 7, 8, 7, 4, 6]
    assert packed.input_ids.shape == (1, sum(lengths))
    assert packed.position_ids[0].tolist() == [i for n in lengths for i in range(n)]
    assert len(packed.keep) == 4 + 2 + 3 + 4 + 1 + 3
    # the first row's prompt ends at packed position 4; it predicts the first completion token
    assert packed.keep[:4].tolist() == [4, 5, 6, 7] and packed.rows[:4].tolist() == [0] * 4
    assert torch.equal(packed.input_ids[0, packed.keep + 1], inputs["input_ids"][packed.rows, 5 + packed.cols])


@pytest.mark.parametrize(
    "attn,chunk_size,lora",
    [("sdpa", 0, False), ("sdpa", 1024, False), ("eager", 0, False), ("eager", 1024, False), ("sdpa", 1024, True)],
)
def test_packed_logps_equal_padded(tiny_model_dir, attn, chunk_size, lora):
    model = _model(tiny_model_dir, attn)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    inputs, c = padded_batch(model.config.vocab_size)
    mask = inputs["attention_mask"][:, -c:].bool()
    results = []
    for padding_free in (False, True):
        model.zero_grad()
        opts = ForwardOptions(temperature=0.9, chunk_size=chunk_size, padding_free=padding_free, share_prompts=False)
        logps, ent = completion_logps(model, inputs, c, opts, compute_entropy=True)
        (logps * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logps.detach()[mask], ent[mask], grads))
    (padded, padded_ent, padded_grads), (packed, packed_ent, packed_grads) = results
    assert torch.allclose(packed, padded, atol=1e-5, rtol=0)
    assert torch.allclose(packed_ent, padded_ent, atol=1e-5, rtol=0)
    assert packed_grads.keys() == padded_grads.keys() and padded_grads
    for name, want in padded_grads.items():
        worst = (packed_grads[name] - want).abs().max().item()
        assert worst <= GRAD_RTOL * want.abs().max().item(), name


def test_rows_packed_together_do_not_see_each_other(tiny_model_dir):
    # the second row's logps are the same whether or not the first row is packed in front of it
    model = _model(tiny_model_dir, "sdpa")
    inputs, c = padded_batch(model.config.vocab_size)
    opts = ForwardOptions(temperature=1.0, chunk_size=1024, padding_free=True, share_prompts=False)
    with torch.no_grad():
        both = completion_logps(model, inputs, c, opts)[0]
        alone = completion_logps(model, {k: v[1:] for k, v in inputs.items()}, c, opts)[0]
    mask = inputs["attention_mask"][1:, -c:].bool()
    assert torch.allclose(both[1:][mask], alone[mask], atol=1e-5, rtol=0)


def test_unsupported_attention_and_extra_inputs_are_refused(tiny_model_dir):
    model = _model(tiny_model_dir, "sdpa")
    inputs, _ = padded_batch(model.config.vocab_size)
    with pytest.raises(ValueError, match=r"padding_free.*pixel_values.*--padding_free false"):
        check_packing(model, {**inputs, "pixel_values": torch.zeros(1)})
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(ValueError, match=r"attention implementation 'paged\|sdpa' does not separate packed rows"):
        check_packing(model, inputs)


def test_training_with_padding_free(tiny_model_dir, math_jsonl, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.trainers.factory import TrainerFactory
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    seen: list[float] = []

    class Probe(GRPOTrainer):
        def _prepare_inputs(self, prompts, rollout=None):
            window = super()._prepare_inputs(prompts, rollout)
            batch = window.batch.to(self.accelerator.device)
            mask = batch.completion_mask.bool()
            with torch.no_grad():
                packed = self._get_per_token_logps_and_entropies(self.model, batch)[0]
                self.args.padding_free = False
                padded = self._get_per_token_logps_and_entropies(self.model, batch)[0]
                self.args.padding_free = True
            seen.append((packed[mask] - padded[mask]).abs().max().item())
            return window

    saved = dict(TrainerFactory.TRAINER_MAPPING)
    TrainerFactory.TRAINER_MAPPING["grpo"] = Probe
    try:
        cfg = parse_train_args(
            flags(
                {"--model": tiny_model_dir, "--dataset": math_jsonl, "--output_dir": tmp_path / "o"},
                "--tuner_type full --num_generations 4 --per_device_train_batch_size 8 --max_completion_length 12",
                "--torch_dtype float32 --max_steps 2 --beta 0.1 --padding_free true --learning_rate 1e-3",
                "--disable_tqdm true --save_steps 100 --plots false",
            )
        )
        trainer = run_train(cfg)
    finally:
        TrainerFactory.TRAINER_MAPPING.clear()
        TrainerFactory.TRAINER_MAPPING.update(saved)
    assert trainer.state.global_step == 2
    assert len(seen) == 2 and max(seen) < 1e-5
