"""Tiny offline vision-language models for tests and benchmarks.

``build_tiny_vlm(dir, family)`` builds a random-init Qwen2-VL, Idefics3 or Gemma3 with hidden size 64 and 2
layers, a byte-level BPE tokenizer (testing.py's, plus the family's image tokens), the family's PIL image
processor and a chat template that renders typed content parts. Everything is saved with ``save_pretrained`` so
that it loads through the same path as a user's model (``grpokit.modeling.load_processor``). No network is used.
"""

from __future__ import annotations

from pathlib import Path

from grpokit.template.processor import image_only
from grpokit.testing import _corpus

FAMILIES = ("qwen2_vl", "idefics3", "gemma3")
IMAGE_SIZE = 16  # pixels a side: every image is resized to this (few patches, few image tokens)

# One ChatML template for all three families; only the text an image part renders as differs.
_VLM_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}IMAGE{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if not (loop.last and continue_final_message is defined and continue_final_message) %}"
    "{{ '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_IMAGE_TEXT = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "idefics3": "<image>",
    "gemma3": "<start_of_image>",
}
_SPECIAL = {
    "qwen2_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "idefics3": ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"],
    "gemma3": ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
}


def _tokenizer(family: str, vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_SPECIAL[family]]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = _corpus(1500, seed) + ["What colour is this image? <answer>red</answer> green blue"] * 50
    tok.train_from_iterator(lines, trainer=trainer)
    extra = {}
    if family == "gemma3":  # Gemma3Processor reads these attributes off the tokenizer
        extra = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        padding_side="left",
        extra_special_tokens=extra,
    )
    hf.chat_template = _VLM_TEMPLATE.replace("IMAGE", _IMAGE_TEXT[family])
    return hf


def _text_config(family: str, vocab: int, hidden: int, layers: int, tok) -> dict:
    cfg = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=1024,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    if family == "qwen2_vl":
        cfg["rope_parameters"] = {"rope_type": "default", "mrope_section": [4, 2, 2], "rope_theta": 10000.0}
    if family == "gemma3":
        cfg.update(sliding_window=64, query_pre_attn_scalar=hidden // 4)
    return cfg


def _vision_config(family: str, hidden: int) -> dict:
    if family == "qwen2_vl":
        return dict(
            depth=2,
            embed_dim=32,
            hidden_size=hidden,
            num_heads=2,
            mlp_ratio=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        )
    return dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=4,
        num_channels=3,
    )


def _parts(family: str, tok, hidden: int, layers: int):
    """(config, image processor, processor class, processor kwargs) of one family."""
    import transformers as tf

    ids = {t: tok.convert_tokens_to_ids(t) for t in _SPECIAL[family]}
    text = _text_config(family, len(tok), hidden, layers, tok)
    vision = _vision_config(family, hidden)
    if family == "qwen2_vl":
        config = tf.Qwen2VLConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            tie_word_embeddings=True,
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
        pixels = IMAGE_SIZE * IMAGE_SIZE
        image_processor = tf.Qwen2VLImageProcessorPil(
            patch_size=4,
            merge_size=2,
            temporal_patch_size=2,
            min_pixels=pixels,
            max_pixels=pixels,
            size={"shortest_edge": pixels, "longest_edge": pixels},
        )
        return config, image_processor, tf.Qwen2VLProcessor, {}
    if family == "idefics3":
        config = tf.Idefics3Config(
            text_config={**text, "model_type": "llama"},
            vision_config=vision,
            scale_factor=2,
            image_token_id=ids["<image>"],
            tie_word_embeddings=True,
        )
        image_processor = tf.Idefics3ImageProcessorPil(
            do_image_splitting=False, size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE}
        )
        return config, image_processor, tf.Idefics3Processor, {"image_seq_len": (IMAGE_SIZE // 4) ** 2 // 4}
    tokens = (IMAGE_SIZE // 4) ** 2 // 4  # Gemma3 pools the patch grid down to mm_tokens_per_image
    config = tf.Gemma3Config(
        text_config={**text, "model_type": "gemma3_text"},
        vision_config={**vision, "model_type": "siglip_vision_model"},
        mm_tokens_per_image=tokens,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=True,
    )
    image_processor = tf.Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False
    )
    return config, image_processor, tf.Gemma3Processor, {"image_seq_length": tokens}


def _aligner_output(model, family: str):
    """The aligner's last projection (vision features -> the language model's embeddings) of ``family``."""
    if family == "qwen2_vl":
        return [model.model.visual.merger.mlp[2].weight, model.model.visual.merger.mlp[2].bias]
    if family == "idefics3":
        return [model.model.connector.modality_projection.proj.weight]
    return [model.model.multi_modal_projector.mm_input_projection_weight]


def build_tiny_vlm(
    out_dir: str | Path,
    family: str = "qwen2_vl",
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    zero_aligner: bool = False,
) -> Path:
    """Build and save a tiny random vision-language model of ``family`` (one of FAMILIES) with its processor.

    ``zero_aligner``: the aligner's output projection starts at zero, so every image reaches the language model as
    the same (zero) embeddings and the untrained model gives every image the same answer, whatever the seed (a
    fresh aligner, as when a VLM is assembled from a vision tower and a language model). Training must then
    update the aligner (``--freeze_aligner false``). Without it, random weights may already tell images apart.
    """
    import torch
    from transformers import AutoModelForImageTextToText

    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: use one of {', '.join(FAMILIES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(family, vocab_size, seed)
    config, image_processor, processor_cls, kwargs = _parts(family, tok, hidden_size, num_layers)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        for weight in _aligner_output(model, family):
            if zero_aligner:
                weight.zero_()
            elif family == "gemma3":  # its projector starts at zero (images would change nothing): draw it
                torch.nn.init.normal_(weight, std=0.2)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = None
    processor = image_only(processor_cls)(
        image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template, **kwargs
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    """python -m grpokit.testing_vlm OUT_DIR [FAMILY] [--seed N] [--zero_aligner]: the model of examples/vlm."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m grpokit.testing_vlm", description=main.__doc__)
    p.add_argument("out_dir")
    p.add_argument("family", nargs="?", default="qwen2_vl", choices=FAMILIES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--zero_aligner",
        action="store_true",
        help="the aligner's output starts at zero: the untrained model answers every image alike",
    )
    a = p.parse_args(argv)
    print(build_tiny_vlm(a.out_dir, a.family, seed=a.seed, zero_aligner=a.zero_aligner))


if __name__ == "__main__":
    main()
