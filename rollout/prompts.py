"""Turn a prompt from the data into token ids, or say precisely why it cannot be used."""
from __future__ import annotations

from rollout.config import PromptOverflow


class PromptError(ValueError):
    """A prompt the run was configured to stop on (prompt_overflow: error)."""


def encode_prompt(tokenizer, prompt, max_tokens: int, overflow: PromptOverflow) -> tuple[list[int] | None, str]:
    """(token ids, "") for a usable prompt, or (None, reason) for one to skip and count.

    Text is tokenized as is; chat messages go through the tokenizer's chat template with the
    generation prompt; token ids pass through. Overlong prompts follow `overflow`.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            return None, "empty prompt"
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        bad = [m for m in prompt if not isinstance(m.get("content"), str) or "role" not in m]
        if bad:
            return None, f"chat message without a string 'content' and a 'role': {bad[0]!r:.80}"
        try:
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as e:  # no template, or one that rejects these messages
            return None, f"chat template failed: {' '.join(str(e).split())[:120]}"
        ids = list(ids["input_ids"]) if isinstance(ids, dict) else list(ids)
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
        if overflow == PromptOverflow.truncate_left:
            return ids[-max_tokens:], ""
        if overflow == PromptOverflow.skip:
            return None, f"prompt has {len(ids)} tokens > max_prompt_tokens {max_tokens}"
        raise PromptError(f"prompt has {len(ids)} tokens > max_prompt_tokens {max_tokens} (prompt_overflow: error)")
    return ids, ""
