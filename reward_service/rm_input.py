"""The reward model's input for one (prompt, response): one function, used by `relay rm` to train
a reward model and by the scoring service to score with it, so that both feed it the same tokens.

    prompt (text | chat messages | the RM tokenizer's token ids) + response text
      -> text: the prompt (messages through the RM tokenizer's chat template with the generation
         prompt; ids decoded with their special tokens) followed by the response
      -> token ids as the tokenizer encodes text by default, one BOS and never two (encode_text)

No EOS is appended beyond what the tokenizer itself adds by default: a sequence classifier reads
the last token that is not padding, and tokenizers that pad with their EOS would hide it.
"""

from __future__ import annotations

import torch

from runtime.prompts import encode_text, is_chat, is_token_ids


def rm_prompt_text(tokenizer, prompt) -> str:
    """The prompt as text in front of the response."""
    if isinstance(prompt, str):
        return prompt
    if is_chat(prompt):
        if not tokenizer.chat_template:
            raise ValueError("a chat prompt, but the reward model's tokenizer has no chat template")
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    if is_token_ids(prompt):
        return tokenizer.decode(prompt, skip_special_tokens=False)  # a template's markers stay
    raise ValueError(f"prompt is {type(prompt).__name__}: expected text, chat messages or token ids")


def rm_input_ids(tokenizer, prompt, response: str) -> list[int]:
    """The token ids the reward model reads for `response` to `prompt` (see the module docstring)."""
    return encode_text(tokenizer, rm_prompt_text(tokenizer, prompt) + response)


def pad_right(seqs: list[list[int]], pad_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (N, longest): right-padded, attention on the real tokens."""
    width = max(len(s) for s in seqs)
    if pad_id is None and any(len(s) < width for s in seqs):
        raise ValueError("the reward model's tokenizer has no pad token to pad a batch with")
    ids = torch.full((len(seqs), width), 0 if pad_id is None else pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], attention[i, : len(s)] = torch.tensor(s, dtype=torch.long), 1
    return ids, attention
