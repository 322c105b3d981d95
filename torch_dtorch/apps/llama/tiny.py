"""A tiny random Llama and an in-memory character tokenizer, built offline (no hub access).

They exist so that ``dtorch llama`` runs on any laptop in seconds and tests compare against single-device
transformers; the weights are random (seeded), so the text is gibberish but deterministic.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TinyLlama", "char_tokenizer", "tiny_config", "tiny_llama"]


@dataclass(frozen=True, kw_only=True)
class TinyLlama:
    """Sizes of the tiny model (GQA: fewer key/value heads than query heads, as Llama-3)."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False


def tiny_config(sizes: TinyLlama | None = None) -> Any:
    from transformers import LlamaConfig

    s = sizes or TinyLlama()
    return LlamaConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=s.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def tiny_llama(sizes: TinyLlama | None = None, *, seed: int = 0) -> Any:
    """A random ``LlamaForCausalLM`` (float32, eval mode), the same for the same ``seed``."""
    from transformers import LlamaForCausalLM

    cfg = tiny_config(sizes)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model.eval()


def char_tokenizer() -> Any:
    """A character-level ``PreTrainedTokenizerFast`` over printable ASCII (ids 3..), with ``<pad>`` 0, ``<s>`` 1,
    ``</s>`` 2 and ``<unk>``; decoding concatenates the characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
