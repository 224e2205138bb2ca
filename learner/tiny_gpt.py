"""Tiny GPT-2 and Llama models with a character tokenizer, saved as plain Hugging Face folders.

relay trains these itself (SFT from scratch) for its fast end-to-end tests and the default CPU demo:
they load in transformers and vLLM like any other checkpoint, and no hub download is involved.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Chat messages are rendered as their contents, one per line: a tiny model has no roles to learn.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
DEFAULT_ALPHABET = "0123456789+-*=?.,:#()[] abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character (ids 0-2 are pad, eos, unk); decoding concatenates."""
    chars = list(dict.fromkeys(alphabet))  # unique, order kept
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))  # no merges = characters
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        bos_token=EOS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def train_bpe_tokenizer(texts, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts` with `tokenizers` (ids 0-2: pad, eos, unk)."""
    from tokenizers import pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, UNK],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        bos_token=EOS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def init_tiny_gpt(
    out_dir: str | Path,
    alphabet: str = DEFAULT_ALPHABET,
    n_layer: int = 2,
    n_embd: int = 128,
    n_head: int = 4,
    n_positions: int = 128,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Write a randomly initialised tiny GPT-2 and its tokenizer (default: characters of
    `alphabet`) to `out_dir`; return the path."""
    out = Path(out_dir)
    tokenizer = tokenizer or char_tokenizer(alphabet)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def init_tiny_llama(
    out_dir: str | Path,
    alphabet: str = DEFAULT_ALPHABET,
    n_layer: int = 2,
    n_embd: int = 128,
    n_head: int = 4,
    n_positions: int = 128,
    seed: int = 0,
) -> Path:
    """Like init_tiny_gpt, in the Llama layout (RMSNorm, RoPE, SwiGLU; no Conv1D transposes) that
    Qwen, Llama and SmolLM2 share: the architecture relay's real runs train."""
    out = Path(out_dir)
    tokenizer = char_tokenizer(alphabet)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=n_embd,
        intermediate_size=n_embd * 8 // 3 // 8 * 8,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_head,
        max_position_embeddings=n_positions,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
