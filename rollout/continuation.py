"""A cut sample joined with its continuation (partial rollouts: RolloutWorker.resume).

The continuation is generated with the response so far as its prompt, so vLLM looks for stop strings
in the new text only: one that begins before the cut and ends after it goes unseen. `joined` looks in
the joined text and ends the sample as vLLM ends an uncut one (vllm/v1/engine/detokenizer.py): the stop
string that completes earliest wins, the text ends before it (after it with include_stop_str_in_output),
finish "stop", and the tokens end with the one that completes it, even when it completes mid-token."""

from __future__ import annotations

import copy


def straddling_stop(head: str, tail: str, stops: list[str]) -> tuple[str, int] | None:
    """The stop string that completes earliest in head + tail, searched from where one could begin
    in `head` and end in `tail` (as vLLM's check_stop_strings searches), and where it begins; None
    when none completes in `tail` or the earliest lies wholly in `tail` (vLLM's own check saw that one)."""
    text, best = head + tail, None
    for stop in stops:
        at = text.find(stop, max(len(head) - len(stop) + 1, 0))
        if at != -1 and (best is None or at + len(stop) < best[1] + len(best[0])):
            best = (stop, at)
    return best if best is not None and best[1] < len(head) else None


def tokens_through(tokenizer, response: list[int], ids: list[int], end: int) -> int:
    """How many of the new tokens `ids` it takes for the response's text to reach `end` characters."""
    decoded = lambda k: tokenizer.decode(response + ids[:k], skip_special_tokens=True)  # noqa: E731
    return next((k for k in range(1, len(ids) + 1) if len(decoded(k)) >= end), len(ids))


def joined(tokenizer, response: list[int], c, params) -> tuple[object, str]:
    """The continuation `c` (a vLLM completion; None: no token, the budget spent) of the cut
    `response`, requested with SamplingParams `params`, and the whole response's text. A stop string
    across the cut ends it there: `c`'s tokens (and so their logprobs and versions) end with the one
    that completes it, its finish is "stop"."""
    if c is None:
        return None, tokenizer.decode(response, skip_special_tokens=True)
    ids = list(c.token_ids)
    if not params.stop:  # one decode of the whole response, as uncut samples get (engine.sampling_params)
        return c, tokenizer.decode(response + ids, skip_special_tokens=True)
    head = tokenizer.decode(response, skip_special_tokens=True)  # vLLM's text of the new tokens follows
    tail = c.text
    own = getattr(c, "stop_reason", None)
    if c.finish_reason == "stop" and isinstance(own, str) and not params.include_stop_str_in_output:
        tail += own  # vLLM took the stop string it met out of the text: one across the cut may end inside it
    found = straddling_stop(head, tail, params.stop)
    if found is None:
        return c, head + c.text
    stop, at = found
    end = at + len(stop)
    keep = tokens_through(tokenizer, response, ids, end)
    cut = copy.copy(c)  # token_versions reads the spans over the tokens kept only
    cut.token_ids, cut.logprobs = ids[:keep], c.logprobs[:keep]
    cut.finish_reason, cut.stop_reason = "stop", stop
    return cut, (head + tail)[: end if params.include_stop_str_in_output else at]
