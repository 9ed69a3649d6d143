"""Tiny random-weight models and a small byte-level tokenizer, built offline in seconds.

Two architectures, Llama and Qwen3, so engine tests cover both families. Weights are
random but fixed by the seed, so greedy outputs are deterministic.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Paged attention keeps keys and values in fixed-size blocks of memory.",
    "Continuous batching schedules new requests while others are decoding.",
    "Héllo wörld, naïve café — 東京 and 😀 emoji need several bytes each.",
    "def main():\n    return sum(range(10))\n",
]


def build_tokenizer(folder: Path, vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE: any text encodes, and multi-byte characters span tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(folder)
    return tokenizer


def build_model(folder: Path, architecture: str, seed: int = 0) -> Path:
    """Save a tiny `architecture` ('llama' or 'qwen3') model with its tokenizer to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    common = dict(
        vocab_size=len(tokenizer),
        # head_dim 32 (128 / 4 heads) is the smallest the C++ decode kernel takes.
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    config: PretrainedConfig
    if architecture == "llama":
        config = LlamaConfig(**common)
    elif architecture == "qwen3":
        config = Qwen3Config(head_dim=32, **common)
    else:
        raise ValueError(f"unknown tiny architecture {architecture!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves logits nearly flat; a wider embedding spread makes greedy
    # choices decisive so fp32 comparisons are not decided by rounding.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 1.0)
    model.save_pretrained(folder)
    return folder
