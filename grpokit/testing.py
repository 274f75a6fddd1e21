"""Tiny offline models for tests and benchmarks, and a server in a thread for the tests that serve one.

``build_tiny_model(dir)`` trains a byte-level BPE tokenizer with ``tokenizers`` on generated text, wraps it as a
``PreTrainedTokenizerFast`` with a ChatML template, builds a random-init Qwen3 model from its config, and saves
both with ``save_pretrained`` so that they load through the same path as a user's model. No network is used.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% if not (loop.last and continue_final_message is defined and continue_final_message) %}"
    "{{ '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML, except that an assistant message before the last user message loses its <think>...</think> block, as
# Qwen3's template does: a template that is not prefix-preserving (multi-turn token-in-token-out tests)
THINK_DROPPING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + content }}"
    "{% if not (loop.last and continue_final_message is defined and continue_final_message) %}"
    "{{ '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = (
        "what is the answer think reason sum add plus minus times number result calculator action input "
        "observation tool user assistant system please compute correct wrong try again final answer "
        "guess higher lower json name value yes no"
    ).split()
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"What is {a} + {b}? <think>{a} plus {b}</think><answer>{a + b}</answer>")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))))
        lines.append(f'Action: calculator\nAction Input: {a} * {b}\nObservation: {a * b} {{"name": "x", "value": {a}}}')
    return lines


def build_tiny_tokenizer(vocab_size: int = 512, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(3000, seed), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        padding_side="left",
    )
    hf.chat_template = CHATML_TEMPLATE
    return hf


def build_tiny_model(
    out_dir: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    seq_cls: bool = False,
    chat_template: str | None = None,
) -> Path:
    """Build and save a tiny Qwen3-style causal LM (or a 1-label sequence classifier) with its tokenizer (and
    ``chat_template`` instead of ChatML when given)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen3Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(vocab_size=vocab_size, seed=seed)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        num_labels=1,
    )
    torch.manual_seed(seed)
    cls = AutoModelForSequenceClassification if seq_cls else AutoModelForCausalLM
    model = cls.from_config(config)
    if not seq_cls:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app, start_timeout_s: float = 30.0):
    """uvicorn serving the ASGI ``app`` on a free loopback port in a daemon thread; yields (url, port) and stops
    it on exit."""
    import uvicorn  # the server's dependency; loaded only by the tests that serve

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start within {start_timeout_s:g}s")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        server.should_exit = True
        thread.join(10)
