"""The agent endpoint's record of its episodes: each chat call as token ids with the behaviour logprobs,
and the finished episodes waiting for an update (rollout/gateway.py serves the calls).

A call whose messages continue the episode's last conversation (the same messages, the model's replies
with their tool calls included, and the same `tools`) extends that sample token for token: the new
messages (a user turn, tool results) through the chat template, masked from the loss; any other call
starts a new sample. So the trained tokens are exactly the sampled ones, tool calls included, and the
messages between them are what the template writes for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from rollout.chat_parsing import same_messages, template_messages
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
    # the version of each token of `ids`: its call's (a message's tokens: the call's before them)
    token_versions: list[int] = field(default_factory=list)
    turns: int = 0
    clipped_turns: int = 0  # calls cut at their max_tokens
    tools: list[dict] | None = None  # the `tools` of its calls, rendered by the chat template
    text: str = ""  # the last call's sampled text, as the engine decoded it


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

    def prepare(self, episode: str, messages: list[dict], max_new_tokens: int, tools: list[dict] | None = None) -> Call:
        """The sample this call extends (or a new one) and the token ids the engine continues. A call
        that cannot fit raises ValueError (its own 400) before it reaches an engine call it would fail."""
        with self.lock:
            self._drop_idle()
            self.last_call[episode] = time.monotonic()
            samples = self.episodes.setdefault(episode, [])
            last = samples[-1] if samples else None
            n = len(last.messages) if last is not None else 0
            if (
                last is not None
                and len(messages) > n
                and last.tools == tools
                and same_messages(messages[:n], last.messages)
            ):
                return self._continue(last, messages, max_new_tokens)
            ids = encode_chat(self.tokenizer, template_messages(messages), tools=tools)
            if len(ids) > self.max_prompt_tokens:
                raise ValueError(
                    f"the messages have {len(ids)} tokens > rollout.max_prompt_tokens {self.max_prompt_tokens}"
                )
            sample = Sample(ids, list(messages), tools=tools)
            samples.append(sample)
            return Call(sample, ids, 0, [], True)

    def _continue(self, last: Sample, messages: list[dict], max_new_tokens: int) -> Call:
        """`last` extended by the new messages' tokens: what the template writes after the model's turn.
        Rendered without `tools`: templates write them before the first turn, never after a model's."""
        new = template_messages(messages[len(last.messages) :])
        delta = continuation_ids(self.tokenizer, new, last.ids[-1] if last.ids else None)
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

    def fail(self, episode: str, call: Call) -> None:
        """The engine failed the call: undo what it added, and mark the episode failed (its reward
        cannot be trusted: the agent saw an error, not the model's answer)."""
        with self.lock:
            s = call.sample
            del s.ids[call.kept_ids :], s.action_mask[call.kept_ids :], s.logprobs[call.kept_ids :]
            del s.token_versions[call.kept_ids :]
            s.messages = call.kept_messages
            samples = self.episodes.get(episode)
            if samples is not None:
                if call.new and s in samples:
                    samples.remove(s)
                self.failed.add(episode)

    def record(
        self,
        episode: str,
        call: Call,
        tokens: list[int],
        logprobs: list[float],
        text: str,
        finish: str,
        version: int,
        message: dict | None = None,
    ) -> None:
        """The engine's answer to `call`; dropped if the episode ended (its reward came) meanwhile.
        `message`: the assistant message as the agent was answered (its content, tool calls; default:
        the text), which a continuing call sends back."""
        with self.lock:
            sample = call.sample
            if not any(s is sample for s in self.episodes.get(episode, [])):
                return
            # the message tokens this call added (tagged now: before the call its version was unknown)
            before = sample.token_versions[-1] if sample.token_versions else version
            sample.token_versions += [before] * (len(sample.ids) - len(sample.token_versions))
            sample.token_versions += [version] * len(tokens)
            sample.ids += tokens
            sample.action_mask += [1] * len(tokens)
            sample.logprobs += logprobs
            sample.messages.append(message or {"role": "assistant", "content": text})
            sample.text = text
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
        batch.response_text.append(s.text)
        batch.finish_reason.append(s.finish)
        batch.action_mask.append(s.action_mask)
        batch.env_return.append(None if failed else reward)  # None: could not judge (reward.invalid decides)
        batch.turns.append(s.turns)
        batch.env_failure.append("error" if failed else "")
        batch.clipped_turns.append(s.clipped_turns)
        batch.token_versions.append(s.token_versions)
        batch.version_first.append(s.versions[0])
        batch.version_last.append(s.versions[-1])
    return batch
