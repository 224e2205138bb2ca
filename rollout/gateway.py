"""An OpenAI-compatible chat-completions endpoint onto the rollout engines, for agent programs.

An agent written against the OpenAI API is trained without rewriting it: point its client at
`http://HOST:PORT/episodes/<id>/v1` (or pass `user=<id>` to /v1), let it run a task, then
POST {"reward": r} to /episodes/<id>/reward. Every call is served by the engines with the current
weights and recorded as token ids with their behaviour logprobs (rollout/recorder.py): a call whose
messages continue the episode's last conversation extends that sample token for token, any other
call starts a new sample. A finished episode's samples train in the next update (Gateway.take),
each with the episode's reward.

Answers come whole or streamed (`stream=true`, rollout/gateway_stream.py). With
rollout.endpoint.tool_parser set, a call's `tools` go into the chat template and the sampled text's
tool calls come back as `tool_calls`; with reasoning_parser, its reasoning as `reasoning_content`
(both through vLLM's parsers, rollout/chat_parsing.py). Either way the sample trains on the sampled
tokens as they were, and the agent's tool results continue it through the template.

Calls sample at rollout.sampling's temperature and top_p, the distribution the learner trains
under: a call asking for others (or forcing a tool call, which constrains sampling) is refused (400,
the field named). A call the engine fails marks its episode failed (trained as could-not-judge,
never as a score); a call that cannot fit is refused alone, before it reaches a batched engine call
whose other calls it would fail.

The endpoint's state (open episodes, finished ones not yet trained) lives in this actor only and is
not checkpointed: a resumed run starts with none, and a reward an agent posts for an episode of the
run before (or any unknown id) is answered 404 and counted (endpoint/unknown_rewards).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

from rollout.chat_parsing import ChatParsers
from rollout.config import EndpointConfig, SamplingConfig
from rollout.gateway_stream import chunks, server_sent_events, token_pieces
from rollout.recorder import Recorder
from rollout.types import RolloutBatch

log = logging.getLogger(__name__)


class Batcher:
    """Requests arriving within `wait_s` of each other go to one engine in one generate call
    (round robin over the engines): concurrent agents share the engines' batch."""

    def __init__(self, workers: list, wait_s: float):
        self.workers, self.wait_s, self.queue = workers, wait_s, []
        self.turn = itertools.count()

    async def complete(self, prompt_ids: list[int], sampling: SamplingConfig):
        future = asyncio.get_running_loop().create_future()
        self.queue.append((prompt_ids, sampling, future))
        if len(self.queue) == 1:
            asyncio.get_running_loop().call_later(self.wait_s, lambda: asyncio.ensure_future(self.flush()))
        return await future

    async def flush(self) -> None:
        batch, self.queue = self.queue, []
        worker = self.workers[next(self.turn) % len(self.workers)]
        try:
            outs, version = await asyncio.wrap_future(
                worker.complete.remote([p for p, _, _ in batch], [s for _, s, _ in batch]).future()
            )
        except Exception as e:  # noqa: BLE001 - every caller gets the engine's error
            for _, _, future in batch:
                future.set_exception(e)
            return
        for (_, _, future), out in zip(batch, outs):
            future.set_result((*out, version))


# OpenAI fields that would change the sampled distribution; the learner trains under the config's
# (its logprobs, the ratio, the gap metric), so a call may not change it: (field, config value, off value)
DISTRIBUTION_FIELDS = (
    ("temperature", lambda s: s.temperature),
    ("top_p", lambda s: s.top_p),
    ("frequency_penalty", lambda s: 0.0),
    ("presence_penalty", lambda s: 0.0),
)


def distribution_change(body: dict, sampling: SamplingConfig) -> str:
    """Why the call is refused ("" if not): a field asking for another distribution than the config's."""
    for key, configured in DISTRIBUTION_FIELDS:
        value = body.get(key)
        if value is None:
            continue
        try:
            differs = float(value) != configured(sampling)
        except (TypeError, ValueError):
            return f"{key}: expected a number, got {value!r}"
        if differs:
            return (
                f"{key}: {value} is refused: relay samples at the configured {configured(sampling)} "
                f"(rollout.sampling), the distribution the learner trains under; omit it or send that value"
            )
    if body.get("logit_bias"):
        return "logit_bias: refused: relay samples rollout.sampling's distribution, the one the learner trains under"
    return ""


def call_params(body: dict, sampling: SamplingConfig, tool_parser: str = "") -> SamplingConfig:
    """One chat call's sampling, or ValueError (its 400) naming the field relay cannot serve."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages: a non-empty list of chat messages is required")
    if body.get("n", 1) != 1:
        raise ValueError("n: only 1 completion per call (an episode is one conversation)")
    if body.get("functions"):
        raise ValueError("functions: the deprecated form is not served: send `tools`")
    if body.get("tools") and not tool_parser:
        raise ValueError(
            "tools: set rollout.endpoint.tool_parser to the model's tool-call format (e.g. hermes, qwen3_xml) "
            "to serve them (or describe tools in the messages)"
        )
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ValueError(
            f"tool_choice: {choice!r} is refused: forcing a call constrains sampling (guided decoding), "
            "a distribution the learner does not train under; use auto or none"
        )
    refused = distribution_change(body, sampling)
    if refused:
        raise ValueError(refused)
    asked = int(body.get("max_tokens") or body.get("max_completion_tokens") or sampling.max_new_tokens)
    return replace(
        sampling,
        n_samples_per_prompt=1,
        stop=list(body.get("stop") or []),
        max_new_tokens=min(asked, sampling.max_new_tokens),
        seed=int(body.get("seed", uuid.uuid4().int % 2**31)),
    )


def completion(model_name: str, message: dict, finish: str, usage: dict, relay: dict) -> dict:
    """The OpenAI chat.completion answer, with relay's token ids, logprobs and policy version beside it."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
        "relay": relay,
    }


def answer(
    parsers: ChatParsers, body: dict, parsed, call_ids: list[int], text: str, finish: str, relay: dict, model: str
):
    """The recorded assistant message of a reply (`relay`: its record) and what the agent gets: the
    chat.completion, or for `stream=true` the chunks of its event stream."""
    tokens = relay["token_ids"]
    usage = {
        "prompt_tokens": len(call_ids),
        "completion_tokens": len(tokens),
        "total_tokens": len(call_ids) + len(tokens),
    }
    if not body.get("stream"):
        message = parsers.message(parsed, text, tokens)
        return message, completion(model, message, _finish_reason(message, finish), usage, relay)
    pieces = token_pieces(parsers.tokenizer, tokens, text)
    deltas = parsers.deltas(parsed, pieces, call_ids)
    message = parsers.streamed_message(deltas)
    wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return message, chunks(
        model, deltas, pieces, _finish_reason(message, finish), usage if wants_usage else None, relay
    )


def _finish_reason(message: dict, finish: str) -> str:
    return "tool_calls" if message.get("tool_calls") and finish == "stop" else finish  # as OpenAI says it


def build_app(recorder: Recorder, batcher: Batcher, sampling: SamplingConfig, model_name: str, parsers=None):
    from fastapi import Body, FastAPI, HTTPException
    from fastapi.responses import StreamingResponse

    app = FastAPI(title="relay agent endpoint")
    parsers = parsers or ChatParsers(recorder.tokenizer)

    async def chat(episode: str, body: dict):
        try:
            params = call_params(body, sampling, parsers.tool_parser)
            parsed = parsers.start(body)
            tools = body.get("tools") or None
            call = await asyncio.to_thread(recorder.prepare, episode, body["messages"], params.max_new_tokens, tools)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        try:
            tokens, logprobs, text, finish, version = await batcher.complete(call.ids, params)
        except Exception as e:  # noqa: BLE001 - an engine failure: the episode cannot be judged; the run goes on
            await asyncio.to_thread(recorder.fail, episode, call)
            log.warning("endpoint: an engine call of episode %r failed: %s", episode, e)
            raise HTTPException(
                503,
                f"the engine failed this call ({type(e).__name__}); episode {episode!r} "
                "is marked failed and will not train as a score",
            ) from None
        relay = {"episode": episode, "token_ids": tokens, "logprobs": logprobs, "policy_version": version}
        message, out = await asyncio.to_thread(answer, parsers, body, parsed, call.ids, text, finish, relay, model_name)
        await asyncio.to_thread(recorder.record, episode, call, tokens, logprobs, text, finish, version, message)
        if body.get("stream"):
            return StreamingResponse(server_sent_events(out), media_type="text/event-stream")
        return out

    @app.post("/episodes/{episode}/v1/chat/completions")
    async def episode_chat(episode: str, body: dict = Body(...)):
        return await chat(episode, body)

    @app.post("/v1/chat/completions")
    async def plain_chat(body: dict = Body(...)):
        return await chat(str(body.get("user") or uuid.uuid4().hex), body)  # no user: every call its own episode

    @app.post("/episodes/{episode}/reward")
    async def reward(episode: str, body: dict = Body(...)):
        try:
            value = float(body["reward"])
        except (KeyError, TypeError, ValueError):
            raise HTTPException(400, 'expected {"reward": <number>}') from None
        if await asyncio.to_thread(recorder.finish, episode, value) is None:
            raise HTTPException(404, f"no open episode {episode!r}")
        return {"episode": episode, "reward": value}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "relay"}]}

    return app


class Gateway:
    """The endpoint in its own Ray actor: an HTTP server on a thread, the engines behind it.
    Create with `ray.remote(Gateway).remote(workers, model_path, cfg, sampling, max_prompt_tokens, max_model_len)`."""

    def __init__(
        self,
        workers: list,
        model_path: str,
        cfg: EndpointConfig,
        sampling: SamplingConfig,
        max_prompt_tokens: int,
        max_model_len: int,
    ):
        import uvicorn
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if cfg.chat_template:  # e.g. one that renders `tools`, where the model's own does not
            tokenizer.chat_template = Path(cfg.chat_template).read_text()
        parsers = ChatParsers(tokenizer, cfg.tool_parser, cfg.reasoning_parser)
        self.recorder = Recorder(tokenizer, max_prompt_tokens, max_model_len, cfg.idle_timeout_s, cfg.max_staleness)
        batcher = Batcher(workers, cfg.batch_wait_ms / 1e3)
        app = build_app(self.recorder, batcher, sampling, "relay-policy", parsers)
        self.server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning"))
        thread = threading.Thread(target=self.server.run, daemon=True, name="relay-gateway")
        thread.start()
        while not self.server.started:
            if not thread.is_alive():
                raise ValueError(f"rollout.endpoint.port: cannot serve on {cfg.host}:{cfg.port} (in use?)")
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.host = cfg.host

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def take(self, n: int, timeout_s: float, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        return self.recorder.take(n, timeout_s, step)

    def shutdown(self) -> None:
        self.server.should_exit = True
