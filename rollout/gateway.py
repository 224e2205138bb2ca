"""An OpenAI-compatible chat-completions endpoint onto the rollout engines, for agent programs.

An agent written against the OpenAI API is trained without rewriting it: point its client at
`http://HOST:PORT/episodes/<id>/v1` (or pass `user=<id>` to /v1), let it run a task, then
POST {"reward": r} to /episodes/<id>/reward. Every call is served by the engines with the current
weights and recorded as token ids with their behaviour logprobs; a call whose messages continue the
episode's last conversation extends that sample token for token (the new messages through the chat
template, masked from the loss), any other call starts a new sample. A finished episode's samples
train in the next update (Gateway.take), each with the episode's reward.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace

from rollout.config import EndpointConfig, SamplingConfig
from rollout.episodes import continuation_ids
from rollout.prompts import encode_chat
from rollout.types import RolloutBatch

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One conversation of an episode as token ids: prompt, then model and message tokens."""
    prompt_ids: list[int]
    messages: list[dict]  # the conversation so far, the model's replies included
    ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)  # 1 = sampled by the engine, 0 = a message's tokens
    logprobs: list[float] = field(default_factory=list)
    finish: str = "stop"
    versions: list[int] = field(default_factory=list)  # the policy version of each call
    turns: int = 0


class Recorder:
    """Episodes by id, their samples, and the finished ones waiting for an update. Thread-safe."""

    def __init__(self, tokenizer, max_prompt_tokens: int, idle_timeout_s: float = 3600.0):
        self.tokenizer, self.max_prompt_tokens, self.idle_timeout_s = tokenizer, max_prompt_tokens, idle_timeout_s
        self.episodes: dict[str, list[Sample]] = {}
        self.last_call: dict[str, float] = {}
        self.finished: deque[tuple[list[Sample], float]] = deque()
        self.abandoned = 0  # episodes dropped after idle_timeout_s without a reward (counted, never trained on)
        self.lock = threading.Condition()

    def prepare(self, episode: str, messages: list[dict]) -> tuple[Sample, list[int]]:
        """The sample this call extends (or a new one) and the token ids the engine continues."""
        with self.lock:
            self._drop_idle()
            self.last_call[episode] = time.monotonic()
            samples = self.episodes.setdefault(episode, [])
            last = samples[-1] if samples else None
            if last is not None and len(messages) > len(last.messages) and _same(messages[: len(last.messages)], last.messages):
                delta = continuation_ids(self.tokenizer, messages[len(last.messages):], last.ids[-1] if last.ids else None)
                last.ids += delta
                last.action_mask += [0] * len(delta)
                last.logprobs += [0.0] * len(delta)
                last.messages = list(messages)
                return last, last.prompt_ids + last.ids
            ids = encode_chat(self.tokenizer, messages)
            if len(ids) > self.max_prompt_tokens:
                raise ValueError(f"the messages have {len(ids)} tokens > rollout.max_prompt_tokens {self.max_prompt_tokens}")
            sample = Sample(ids, list(messages))
            samples.append(sample)
            return sample, ids

    def record(self, sample: Sample, tokens: list[int], logprobs: list[float], text: str, finish: str, version: int) -> None:
        with self.lock:
            sample.ids += tokens
            sample.action_mask += [1] * len(tokens)
            sample.logprobs += logprobs
            sample.messages.append({"role": "assistant", "content": text})
            sample.finish, sample.turns = finish, sample.turns + 1
            sample.versions.append(version)

    def _drop_idle(self) -> None:
        """An agent that crashed never posts its reward: its episode is dropped once idle too long."""
        now = time.monotonic()
        for episode in [e for e, t in self.last_call.items() if now - t > self.idle_timeout_s]:
            self.episodes.pop(episode, None)
            self.last_call.pop(episode)
            self.abandoned += 1
            log.warning("endpoint: episode %r had no call and no reward for %.0f s; dropped", episode, self.idle_timeout_s)

    def finish(self, episode: str, reward: float) -> int:
        """End the episode with its reward; returns its samples (0: no such episode)."""
        with self.lock:
            self.last_call.pop(episode, None)
            samples = self.episodes.pop(episode, [])
            if samples:
                self.finished.append((samples, reward))
                self.lock.notify_all()
            return len(samples)

    def take(self, n: int, timeout_s: float) -> tuple[RolloutBatch, int, int]:
        """At least n samples of finished episodes (whole episodes, oldest first), waiting up to
        timeout_s; returns the batch (one prompt per sample), the episodes in it and the episodes
        abandoned so far."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            self._drop_idle()
            while sum(len(s) for s, _ in self.finished) < n:
                if not self.lock.wait(timeout=max(0.0, deadline - time.monotonic())):
                    have = sum(len(s) for s, _ in self.finished)
                    raise TimeoutError(f"{have} of {n} samples from finished episodes within {timeout_s} s "
                                       "(rollout.endpoint.wait_timeout_s): is the agent program running?")
            taken = []
            while sum(len(s) for s, _ in taken) < n:
                taken.append(self.finished.popleft())
        batch = RolloutBatch([], [], [], [], [], [])
        for samples, reward in taken:
            for s in samples:
                batch.prompt_index.append(len(batch.prompt_index))
                batch.prompt_ids.append(s.prompt_ids)
                batch.response_ids.append(s.ids)
                batch.logprobs.append(s.logprobs)
                batch.response_text.append(s.messages[-1]["content"])
                batch.finish_reason.append(s.finish)
                batch.action_mask.append(s.action_mask)
                batch.env_return.append(reward)
                batch.turns.append(s.turns)
                batch.env_failure.append("")
                batch.version_first.append(s.versions[0])
                batch.version_last.append(s.versions[-1])
        return batch, len(taken), self.abandoned


def _same(a: list[dict], b: list[dict]) -> bool:
    return all(x.get("role") == y.get("role") and x.get("content") == y.get("content") for x, y in zip(a, b))


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
                worker.complete.remote([p for p, _, _ in batch], [s for _, s, _ in batch]).future())
        except Exception as e:  # noqa: BLE001 - every caller gets the engine's error
            for _, _, future in batch:
                future.set_exception(e)
            return
        for (_, _, future), out in zip(batch, outs):
            future.set_result((*out, version))


def build_app(recorder: Recorder, batcher: Batcher, sampling: SamplingConfig, model_name: str):
    from fastapi import Body, FastAPI, HTTPException

    app = FastAPI(title="relay agent endpoint")

    async def chat(episode: str, body: dict) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HTTPException(400, "messages: a non-empty list of chat messages is required")
        if body.get("n", 1) != 1:
            raise HTTPException(400, "n: only 1 completion per call (an episode is one conversation)")
        for key in ("stream", "tools", "functions"):  # answered plainly rather than ignored
            if body.get(key):
                raise HTTPException(400, f"{key}: not supported by relay's endpoint yet (describe tools in the messages)")
        params = replace(sampling, n_samples_per_prompt=1, stop=list(body.get("stop") or []),
                         temperature=float(body.get("temperature", sampling.temperature)),
                         top_p=float(body.get("top_p", sampling.top_p)),
                         max_new_tokens=min(int(body.get("max_tokens") or body.get("max_completion_tokens")
                                                or sampling.max_new_tokens), sampling.max_new_tokens),
                         seed=int(body.get("seed", uuid.uuid4().int % 2**31)))
        try:
            sample, ids = await asyncio.to_thread(recorder.prepare, episode, messages)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        tokens, logprobs, text, finish, version = await batcher.complete(ids, params)
        await asyncio.to_thread(recorder.record, sample, tokens, logprobs, text, finish, version)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model_name, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                  "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)},
                "relay": {"episode": episode, "token_ids": tokens, "logprobs": logprobs, "policy_version": version}}

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
        if not await asyncio.to_thread(recorder.finish, episode, value):
            raise HTTPException(404, f"no open episode {episode!r}")
        return {"episode": episode, "reward": value}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "relay"}]}

    return app


class Gateway:
    """The endpoint in its own Ray actor: an HTTP server on a thread, the engines behind it.
    Create with `ray.remote(Gateway).remote(workers, model_path, cfg, sampling, max_prompt_tokens)`."""

    def __init__(self, workers: list, model_path: str, cfg: EndpointConfig, sampling: SamplingConfig,
                 max_prompt_tokens: int):
        import uvicorn
        from transformers import AutoTokenizer

        self.recorder = Recorder(AutoTokenizer.from_pretrained(model_path), max_prompt_tokens, cfg.idle_timeout_s)
        app = build_app(self.recorder, Batcher(workers, cfg.batch_wait_ms / 1e3), sampling, "relay-policy")
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

    def take(self, n: int, timeout_s: float) -> tuple[RolloutBatch, int, int]:
        return self.recorder.take(n, timeout_s)

    def shutdown(self) -> None:
        self.server.should_exit = True
