"""Turn a prompt from the data into token ids, or say precisely why it cannot be used: the one
encoding the data stage, the rollout engines and the reward models' inputs share."""

from __future__ import annotations

from enum import Enum


class PromptOverflow(str, Enum):
    """What to do with a prompt longer than max_prompt_tokens (rollout.prompt_overflow)."""

    truncate_left = "truncate_left"  # keep the last max_prompt_tokens tokens (the question usually ends there)
    skip = "skip"  # drop the sample, count it under rollout/skipped_prompts
    error = "error"  # stop the run


class PromptError(ValueError):
    """A prompt the run was configured to stop on (prompt_overflow: error)."""


def is_chat(prompt) -> bool:
    """A non-empty list of chat messages (dicts with a string 'content')."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt)
    )


def is_token_ids(prompt) -> bool:
    """A non-empty list of non-negative ints (bools are not token ids)."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    )


def encode_text(tokenizer, text: str) -> list[int]:
    """Text as the model's tokenizer encodes it by default: Llama, Mistral and Gemma tokenizers put
    a BOS first, which their models were trained on. A text that already starts with the BOS
    (a rendered chat template, a prompt written with it) keeps one, not two."""
    ids = tokenizer(text).input_ids
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:2] == [bos, bos]:
        plain = tokenizer(text, add_special_tokens=False).input_ids
        if plain[:1] == [bos] and len(ids) > len(plain):  # the tokenizer added a BOS before the text's own
            return ids[1:]
    return ids


def encode_chat(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> list[int]:
    """Chat messages (and the OpenAI `tools` an agent offers, if any) through the tokenizer's chat
    template. The template writes any BOS itself, so the tokenizer adds no special tokens: what
    transformers 5 does for tokenize=True, spelled out here so that no version or template can double the BOS."""
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def encode_prompt(tokenizer, prompt, max_tokens: int, overflow: PromptOverflow) -> tuple[list[int] | None, str]:
    """(token ids, "") for a usable prompt, or (None, reason) for one to skip and count.

    Text is tokenized as the tokenizer does by default (encode_text: a BOS where the model expects
    one); chat messages go through the tokenizer's chat template with the generation prompt
    (encode_chat); token ids pass through. Overlong prompts follow `overflow`.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            return None, "empty prompt"
        ids = encode_text(tokenizer, prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        bad = [m for m in prompt if not isinstance(m.get("content"), str) or "role" not in m]
        if bad:
            return None, f"chat message without a string 'content' and a 'role': {bad[0]!r:.80}"
        try:
            ids = encode_chat(tokenizer, prompt)
        except Exception as e:  # no template, or one that rejects these messages
            return None, f"chat template failed: {' '.join(str(e).split())[:120]}"
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        if max(ids) >= len(tokenizer) or min(ids) < 0:
            return None, f"token id out of the vocabulary (size {len(tokenizer)})"
    elif isinstance(prompt, list) and not prompt:
        return None, "empty prompt"
    else:
        return None, f"prompt is {type(prompt).__name__}; expected text, chat messages or token ids"
    if not ids:
        return None, "prompt has no tokens"
    if len(ids) > max_tokens:
        if overflow == PromptOverflow.truncate_left:  # the question's end stays, and so does a leading BOS
            keep = 1 if ids[0] == tokenizer.bos_token_id and max_tokens > 1 else 0
            return ids[:keep] + ids[len(ids) - max_tokens + keep :], ""
        if overflow == PromptOverflow.skip:
            return None, f"prompt has {len(ids)} tokens > max_prompt_tokens {max_tokens}"
        raise PromptError(f"prompt has {len(ids)} tokens > max_prompt_tokens {max_tokens} (prompt_overflow: error)")
    return ids, ""
