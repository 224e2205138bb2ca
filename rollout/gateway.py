"""An OpenAI-compatible chat-completions endpoint onto the rollout engines, for agent programs.

An agent written against the OpenAI API is trained without rewriting it: point its client at
`http://HOST:PORT/episodes/<id>/v1` (or pass `user=<id>` to /v1), let it run a task, then
POST {"reward": r} to /episodes/<id>/reward. Every call is served by the engines with the current
weights and recorded as token ids with their behaviour logprobs; a call whose messages continue the
episode's last conversation extends that sample token for token (the new messages through the chat
template, masked from the loss), any other call starts a new sample. A finished episode's samples
train in the next update (Gateway.take), each with the episode's reward.

Calls sample at rollout.sampling's temperature and top_p, the distribution the learner trains
under: a call asking for others is refused (400, the field named). A call the engine fails marks its
episode failed (trained as could-not-judge, never as a score); a call that cannot fit is refused
alone, before it reaches a batched engine call whose other calls it would fail.

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
from collections import deque
from dataclasses import dataclass, field, replace

from rollout.config import EndpointConfig, SamplingConfig
from rollout.episodes import continuation_ids
from rollout.types import RolloutBatch
from runtime.prompts import encode_chat

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
    clipped_turns: int = 0  # calls cut at their max_tokens


@dataclass
class Call:
    """One chat call in flight: its sample, the token ids the engine continues, and what the
    sample was before it (to undo a call the engine failed)."""

    sample: Sample
    ids: list[int]
    kept_ids: int  # the sample's tokens before this call's message tokens
    kept_messages: list[dict]
    new: bool  # the call started the sample


class Recorder:
    """Episodes by id, their samples, and the finished ones waiting for an update. Thread-safe."""

    def __init__(
        self,
        tokenizer,
        max_prompt_tokens: int,
        max_model_len: int,
        idle_timeout_s: float = 3600.0,
        max_staleness: int = 1,
    ):
        self.tokenizer, self.max_prompt_tokens, self.max_model_len = tokenizer, max_prompt_tokens, max_model_len
        self.idle_timeout_s, self.max_staleness = idle_timeout_s, max_staleness
        self.episodes: dict[str, list[Sample]] = {}
        self.last_call: dict[str, float] = {}
        self.failed: set[str] = set()  # open episodes with a call the engine failed: they cannot be judged
        self.finished: deque[tuple[list[Sample], float, bool]] = deque()  # (samples, reward, failed)
        self.counts = {
            "endpoint/abandoned_episodes": 0.0,  # dropped after idle_timeout_s without a reward
            "endpoint/failed_episodes": 0.0,  # had a failed engine call: trained as could-not-judge
            "endpoint/dropped_stale": 0.0,  # samples older than rollout.endpoint.max_staleness
            "endpoint/unknown_rewards": 0.0,
        }  # rewards for no open episode (404; e.g. after a resume)
        self.lock = threading.Condition()

    @property
    def abandoned(self) -> int:
        return int(self.counts["endpoint/abandoned_episodes"])

    def prepare(self, episode: str, messages: list[dict], max_new_tokens: int) -> Call:
        """The sample this call extends (or a new one) and the token ids the engine continues. A call
        that cannot fit raises ValueError (its own 400) before it reaches an engine call it would fail."""
        with self.lock:
            self._drop_idle()
            self.last_call[episode] = time.monotonic()
            samples = self.episodes.setdefault(episode, [])
            last = samples[-1] if samples else None
            n = len(last.messages) if last is not None else 0
            if last is not None and len(messages) > n and _same(messages[:n], last.messages):
                delta = continuation_ids(self.tokenizer, messages[n:], last.ids[-1] if last.ids else None)
                need = len(last.prompt_ids) + len(last.ids) + len(delta) + max_new_tokens
                if need > self.max_model_len:
                    raise ValueError(
                        f"the conversation has {need - max_new_tokens} tokens + max_tokens "
                        f"{max_new_tokens} > rollout.max_model_len {self.max_model_len}"
                    )
                call = Call(last, [], len(last.ids), last.messages, False)
                last.ids += delta
                last.action_mask += [0] * len(delta)
                last.logprobs += [0.0] * len(delta)
                last.messages = list(messages)
                call.ids = last.prompt_ids + last.ids
                return call
            ids = encode_chat(self.tokenizer, messages)
            if len(ids) > self.max_prompt_tokens:
                raise ValueError(
                    f"the messages have {len(ids)} tokens > rollout.max_prompt_tokens {self.max_prompt_tokens}"
                )
            sample = Sample(ids, list(messages))
            samples.append(sample)
            return Call(sample, ids, 0, [], True)

    def fail(self, episode: str, call: Call) -> None:
        """The engine failed the call: undo what it added, and mark the episode failed (its reward
        cannot be trusted: the agent saw an error, not the model's answer)."""
        with self.lock:
            s = call.sample
            del s.ids[call.kept_ids :], s.action_mask[call.kept_ids :], s.logprobs[call.kept_ids :]
            s.messages = call.kept_messages
            samples = self.episodes.get(episode)
            if samples is not None:
                if call.new and s in samples:
                    samples.remove(s)
                self.failed.add(episode)

    def record(
        self, episode: str, call: Call, tokens: list[int], logprobs: list[float], text: str, finish: str, version: int
    ) -> None:
        """The engine's answer to `call`; dropped if the episode ended (its reward came) meanwhile."""
        with self.lock:
            sample = call.sample
            if not any(s is sample for s in self.episodes.get(episode, [])):
                return
            sample.ids += tokens
            sample.action_mask += [1] * len(tokens)
            sample.logprobs += logprobs
            sample.messages.append({"role": "assistant", "content": text})
            sample.finish, sample.turns = finish, sample.turns + 1
            sample.clipped_turns += finish == "length"
            sample.versions.append(version)

    def _drop_idle(self) -> None:
        """An agent that crashed never posts its reward: its episode is dropped once idle too long."""
        now = time.monotonic()
        for episode in [e for e, t in self.last_call.items() if now - t > self.idle_timeout_s]:
            self.episodes.pop(episode, None)
            self.last_call.pop(episode)
            self.failed.discard(episode)
            self.counts["endpoint/abandoned_episodes"] += 1
            log.warning(
                "endpoint: episode %r had no call and no reward for %.0f s; dropped", episode, self.idle_timeout_s
            )

    def finish(self, episode: str, reward: float) -> int | None:
        """End the episode with its reward; returns its samples (None: no such episode)."""
        with self.lock:
            if episode not in self.episodes:
                self.counts["endpoint/unknown_rewards"] += 1
                return None
            self.last_call.pop(episode, None)
            samples = [s for s in self.episodes.pop(episode) if s.versions]  # a call still in flight sampled nothing
            failed = episode in self.failed
            self.failed.discard(episode)
            self.counts["endpoint/failed_episodes"] += failed
            if samples:
                self.finished.append((samples, reward, failed))
                self.lock.notify_all()
            return len(samples)

    def take(self, n: int, timeout_s: float, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Exactly n samples of finished episodes (oldest first; an episode's remaining samples wait
        for the next batch), none sampled more than max_staleness policy versions before `step`
        (older ones are dropped, counted); waits up to timeout_s. Returns the batch (one prompt per
        sample; a failed episode's samples carry env_return None) and the endpoint's counters."""
        deadline, taken, episodes = time.monotonic() + timeout_s, [], 0
        with self.lock:
            self._drop_idle()
            while len(taken) < n:
                if not self.finished and not self.lock.wait(timeout=max(0.0, deadline - time.monotonic())):
                    stale = self.counts["endpoint/dropped_stale"]
                    self.finished.extendleft(([s], r, f) for s, r, f in reversed(taken))  # kept, in order, for a retry
                    raise TimeoutError(
                        f"{len(taken)} of {n} samples from finished episodes within {timeout_s} s "
                        f"(rollout.endpoint.wait_timeout_s; {stale:.0f} stale samples dropped so far, "
                        "rollout.endpoint.max_staleness): is the agent program running?"
                    )
                if not self.finished:
                    continue
                samples, reward, failed = self.finished.popleft()
                fresh = [s for s in samples if step - s.versions[0] <= self.max_staleness]
                self.counts["endpoint/dropped_stale"] += len(samples) - len(fresh)
                room = n - len(taken)
                if len(fresh) > room:
                    self.finished.appendleft((fresh[room:], reward, failed))
                episodes += bool(fresh)
                taken += [(s, reward, failed) for s in fresh[:room]]
            counts = {"endpoint/episodes": float(episodes), **self.counts}
        return _batch(taken), counts


def _batch(taken: list[tuple[Sample, float, bool]]) -> RolloutBatch:
    batch = RolloutBatch([], [], [], [], [], [])
    for s, reward, failed in taken:
        batch.prompt_index.append(len(batch.prompt_index))
        batch.prompt_ids.append(s.prompt_ids)
        batch.response_ids.append(s.ids)
        batch.logprobs.append(s.logprobs)
        batch.response_text.append(next(m["content"] for m in reversed(s.messages) if m["role"] == "assistant"))
        batch.finish_reason.append(s.finish)
        batch.action_mask.append(s.action_mask)
        batch.env_return.append(None if failed else reward)  # None: could not judge (reward.invalid decides)
        batch.turns.append(s.turns)
        batch.env_failure.append("error" if failed else "")
        batch.clipped_turns.append(s.clipped_turns)
        batch.version_first.append(s.versions[0])
        batch.version_last.append(s.versions[-1])
    return batch


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


def call_params(body: dict, sampling: SamplingConfig) -> SamplingConfig:
    """One chat call's sampling, or ValueError (its 400) naming the field relay cannot serve."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: a non-empty list of chat messages is required")
    if body.get("n", 1) != 1:
        raise ValueError("n: only 1 completion per call (an episode is one conversation)")
    for key in ("stream", "tools", "functions"):  # answered plainly rather than ignored
        if body.get(key):
            raise ValueError(f"{key}: not supported by relay's endpoint yet (describe tools in the messages)")
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


def completion(
    model_name: str,
    episode: str,
    ids: list[int],
    tokens: list[int],
    logprobs: list[float],
    text: str,
    finish: str,
    version: int,
) -> dict:
    """The OpenAI chat.completion answer, with relay's token ids, logprobs and policy version beside it."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}
        ],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)},
        "relay": {"episode": episode, "token_ids": tokens, "logprobs": logprobs, "policy_version": version},
    }


def build_app(recorder: Recorder, batcher: Batcher, sampling: SamplingConfig, model_name: str):
    from fastapi import Body, FastAPI, HTTPException

    app = FastAPI(title="relay agent endpoint")

    async def chat(episode: str, body: dict) -> dict:
        try:
            params = call_params(body, sampling)
            call = await asyncio.to_thread(recorder.prepare, episode, body["messages"], params.max_new_tokens)
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
        await asyncio.to_thread(recorder.record, episode, call, tokens, logprobs, text, finish, version)
        return completion(model_name, episode, call.ids, tokens, logprobs, text, finish, version)

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

        self.recorder = Recorder(
            AutoTokenizer.from_pretrained(model_path),
            max_prompt_tokens,
            max_model_len,
            cfg.idle_timeout_s,
            cfg.max_staleness,
        )
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

    def take(self, n: int, timeout_s: float, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        return self.recorder.take(n, timeout_s, step)

    def shutdown(self) -> None:
        self.server.should_exit = True
