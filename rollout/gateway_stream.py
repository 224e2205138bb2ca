"""The agent endpoint's streamed answers (`stream=true`): a finished completion as OpenAI's Server-Sent
Events, one `chat.completion.chunk` per sampled token (or per tokens that decode to text together).

The engines return whole completions, so a stream is cut from the finished one: its pieces concatenate
to exactly the non-streamed text. Chunks come as OpenAI sends them: the role first, then the deltas
(content, `reasoning_content`, `tool_calls` from vLLM's streaming parsers), a last chunk with the
finish reason, a usage chunk where `stream_options.include_usage` asks for it, then `data: [DONE]`.
Each chunk carries its token ids beside it (`relay.token_ids`); the last one also the whole record.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator


def token_pieces(tokenizer, tokens: list[int], text: str) -> list[tuple[str, list[int]]]:
    """`text` cut at token boundaries: (piece, its token ids), the pieces concatenating to `text`.
    A token that ends inside a character (or decodes past `text`, e.g. into a stop string) waits
    for the next; the last piece takes what remains, the final EOS among its tokens."""
    pieces, sent, pending = [], 0, []
    for k, token in enumerate(tokens):
        pending.append(token)
        prefix = tokenizer.decode(tokens[: k + 1], skip_special_tokens=True)
        if len(prefix) > sent and text.startswith(prefix) and not prefix.endswith("\ufffd"):
            pieces.append((prefix[sent:], pending))
            sent, pending = len(prefix), []
    if pending or sent < len(text) or not pieces:
        pieces.append((text[sent:], pending))
    return pieces


def chunks(
    model_name: str,
    deltas: list[dict],
    pieces: list[tuple[str, list[int]]],
    finish: str,
    usage: dict | None,
    relay: dict,
) -> list[dict]:
    """The stream's chunks: the role, one per non-empty delta (token ids of pieces whose delta was
    empty go with the next one), the finish reason (with relay.completion: the whole record, as the
    non-streamed answer's `relay`), then the usage chunk where `usage` is given."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time())}
    head["model"] = model_name

    def chunk(delta: dict, ids: list[int], finish_reason: str | None = None) -> dict:
        out = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        if usage is not None:
            out["usage"] = None  # as OpenAI: null on every chunk but the usage chunk
        return {**out, "relay": {"token_ids": ids}}

    out, pending = [chunk({"role": "assistant", "content": ""}, [])], []
    for delta, (_, ids) in zip(deltas, pieces):
        pending += ids
        if delta:
            out.append(chunk(delta, pending))
            pending = []
    last = chunk({}, pending, finish)
    last["relay"]["completion"] = relay
    out.append(last)
    if usage is not None:
        out.append({**head, "choices": [], "usage": usage})
    return out


def server_sent_events(stream: list[dict]) -> Iterator[str]:
    """The chunks as the `text/event-stream` body OpenAI clients read."""
    for c in stream:
        yield f"data: {json.dumps(c)}\n\n"
    yield "data: [DONE]\n\n"
