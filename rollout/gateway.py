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

Each field of a call is served as OpenAI's API defines it or refused (400, the field named), as one
table says (rollout/gateway_request.py): calls sample at rollout.sampling's temperature and top_p,
the distribution the learner trains under, so a call asking for others (or forcing a tool call,
which constrains sampling) is refused; its stop strings add to the config's. A call the engine
fails marks its episode failed (trained as could-not-judge, never as a score); a call that cannot
fit is refused alone, before it reaches a batched engine call whose other calls it would fail.

The endpoint's state (open episodes, finished ones not yet trained) lives in this actor only and is
not checkpointed: a resumed run starts with none, and a reward an agent posts for an episode of the
run before (or any unknown id) is answered 404 and counted (endpoint/unknown_rewards).

Listening beyond loopback needs a key (RELAY_ENDPOINT_KEY), which every call must send as
`Authorization: Bearer <key>` (an OpenAI client's api_key); without it a call is answered 401 and
counted (endpoint/unauthorized): a reward anyone could post would train the policy
(runtime/endpoint_auth.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
import uuid
from pathlib import Path

from rollout.chat_parsing import ChatParsers
from rollout.config import EndpointConfig, SamplingConfig
from rollout.gateway_request import parse_request
from rollout.gateway_stream import chunks, server_sent_events, token_pieces
from rollout.recorder import Recorder
from rollout.types import RolloutBatch
from runtime.endpoint_auth import ENDPOINT_KEY_ENV, KeyCheck, keyless_exposure, protect

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
        out = [completion(model, message, _finish_reason(message, finish), usage, relay)]
    else:
        pieces = token_pieces(parsers.tokenizer, tokens, text)
        deltas = parsers.deltas(parsed, pieces, call_ids)
        message = parsers.streamed_message(deltas)
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        out = chunks(model, deltas, pieces, _finish_reason(message, finish), usage if wants_usage else None, relay)
    if body.get("logprobs"):
        with_logprobs(out, parsers.tokenizer, relay["logprobs"])
    return message, out if body.get("stream") else out[0]


def with_logprobs(answers: list[dict], tokenizer, logprobs: list[float]) -> None:
    """OpenAI's `choices[0].logprobs` on a completion or on each chunk: every token the choice carries
    (its `relay.token_ids`, or the record's in a completion), its text, bytes and sampled logprob."""
    k = 0
    for a in answers:
        ids = a["relay"]["token_ids"] if "relay" in a and a["choices"] else []
        if ids:
            content = [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip((tokenizer.decode([i]) for i in ids), logprobs[k : k + len(ids)])
            ]
            a["choices"][0]["logprobs"] = {"content": content, "refusal": None}
            k += len(ids)


def served_call(recorder: Recorder, parsers: ChatParsers, sampling: SamplingConfig, episode: str | None, body: dict):
    """A call as relay serves it: (its request, its episode, the parsers' state, the recorder's call),
    or ValueError (its 400). episode None (`/v1`): the call's `user` names it, else it is its own."""
    request = parse_request(body, sampling, parsers.tool_parser)
    body = request.body  # nulls dropped: not given
    episode = episode or body.get("user") or uuid.uuid4().hex
    parsed = parsers.start(body)
    call = recorder.prepare(episode, body["messages"], request.sampling.max_new_tokens, body.get("tools") or None)
    return request, episode, parsed, call


def bad_request(e: ValueError):
    """A call relay does not serve: 400, in OpenAI's error shape (`param` names the field, so a client's
    BadRequestError says it) with FastAPI's `detail` beside it."""
    from fastapi.responses import JSONResponse

    error = {"message": str(e), "type": "invalid_request_error", "param": getattr(e, "field", None), "code": None}
    return JSONResponse({"detail": str(e), "error": error}, status_code=400)


def _finish_reason(message: dict, finish: str) -> str:
    return "tool_calls" if message.get("tool_calls") and finish == "stop" else finish  # as OpenAI says it


def build_app(
    recorder: Recorder, batcher: Batcher, sampling: SamplingConfig, model_name: str, parsers=None, check=None
):
    """The endpoint's FastAPI app; `check` (a KeyCheck) answers calls without its key 401, every route."""
    from fastapi import Body, FastAPI, HTTPException
    from fastapi.responses import StreamingResponse

    app = FastAPI(title="relay agent endpoint")
    protect(app, check or KeyCheck())
    parsers = parsers or ChatParsers(recorder.tokenizer)

    async def chat(episode: str | None, body: dict):
        try:
            request, episode, parsed, call = await asyncio.to_thread(
                served_call, recorder, parsers, sampling, episode, body
            )
        except ValueError as e:
            return bad_request(e)
        body, params = request.body, request.sampling
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
        return await chat(None, body)  # the call's `user` names its episode

    @app.post("/episodes/{episode}/reward")
    async def reward(episode: str, body: dict = Body(...)):
        value = body.get("reward")
        # a number, as JSON has it: not true (float(True) is 1.0), not "0.7", not NaN or infinity
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise HTTPException(400, f'reward: expected {{"reward": <finite number>}}, got {value!r}')
        value = float(value)
        if await asyncio.to_thread(recorder.finish, episode, value) is None:
            raise HTTPException(404, f"no open episode {episode!r}")
        return {"episode": episode, "reward": value}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "relay"}]}

    return app


class Gateway:
    """The endpoint in its own Ray actor: an HTTP server on a thread, the engines behind it.
    Create with `ray.remote(Gateway).remote(workers, model_path, cfg, sampling, max_prompt_tokens, max_model_len,
    api_key)`: with a key (RELAY_ENDPOINT_KEY), every call must send it; beyond loopback one is required."""

    def __init__(
        self,
        workers: list,
        model_path: str,
        cfg: EndpointConfig,
        sampling: SamplingConfig,
        max_prompt_tokens: int,
        max_model_len: int,
        api_key: str = "",
    ):
        refused = keyless_exposure(cfg.host, api_key, ENDPOINT_KEY_ENV)
        if refused:  # before anything is loaded or served
            raise ValueError(f"rollout.endpoint.host: {refused}")
        import uvicorn
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if cfg.chat_template:  # e.g. one that renders `tools`, where the model's own does not
            tokenizer.chat_template = Path(cfg.chat_template).read_text()
        parsers = ChatParsers(tokenizer, cfg.tool_parser, cfg.reasoning_parser)
        self.recorder = Recorder(tokenizer, max_prompt_tokens, max_model_len, cfg.idle_timeout_s, cfg.max_staleness)
        batcher = Batcher(workers, cfg.batch_wait_ms / 1e3)
        self.check = KeyCheck(api_key)
        app = build_app(self.recorder, batcher, sampling, "relay-policy", parsers, self.check)
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
        batch, counts = self.recorder.take(n, timeout_s, step)
        return batch, counts | {"endpoint/unauthorized": float(self.check.refused)}  # calls refused 401

    def shutdown(self) -> None:
        self.server.should_exit = True
