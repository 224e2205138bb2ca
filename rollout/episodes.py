"""Multi-turn episodes, token in / token out: the engine samples a turn, the environment answers, the
answer's tokens are appended, and the engine samples the next turn from the episode's token ids.

The model's tokens are kept exactly as the engine sampled them (never decoded and re-tokenised), with
their behaviour logprobs; observation tokens come from the chat template alone and are marked 0 in
the action mask, so the learner gives them no gradient and no KL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from envs.base import call_all, step_result
from envs.config import EnvConfig
from rollout.async_engine import token_versions
from rollout.config import RolloutConfig, SamplingConfig
from rollout.engine import completion_text, sampled_logprobs, sampling_params
from rollout.types import Prompt, RolloutBatch
from runtime.prompts import encode_prompt

log = logging.getLogger(__name__)
SENTINEL = "RELAY-END-OF-TURN"  # assistant content whose end marks where an observation's tokens start


@dataclass
class Episode:
    """One multi-turn episode in play: its environment and seed, and the tokens, action mask and
    behaviour logprobs it has gathered so far."""

    index: int  # the prompt's global index
    prompt_ids: list[int]
    env: Any
    seed: int
    ids: list[int] = field(default_factory=list)  # after the prompt: model and observation tokens
    action_mask: list[int] = field(default_factory=list)  # 1 = sampled by the model, 0 = observation
    logprobs: list[float] = field(default_factory=list)  # behaviour logprob per token (0.0 on observations)
    versions: list[int] = field(default_factory=list)  # the policy version per token (observations: their turn's)
    turns: int = 0
    clipped_turns: int = 0  # turns cut at max_new_tokens (the episode may go on: not its finish)
    ret: float = 0.0  # the sum of the environment's rewards
    failure: str = ""  # "", "timeout" or "error": the environment failed and the episode ended
    finish: str = "stop"  # "stop": the environment ended it; "length": the token budget ran out; "turns": max_turns
    done: bool = False
    last_text: str = ""  # the model's last turn as text: what text reward sources score (never an observation)


def observation_ids(tokenizer, text: str, role: str, last_token: int | None) -> list[int]:
    """Tokens carrying an observation (a `role` message) to the model after its turn; see continuation_ids."""
    if tokenizer.chat_template is None:
        return tokenizer.encode(text, add_special_tokens=False)
    return continuation_ids(tokenizer, [{"role": role, "content": text}], last_token)


def continuation_ids(tokenizer, messages: list[dict], last_token: int | None) -> list[int]:
    """Tokens of `messages` following a model turn: what the chat template writes after an assistant
    message's content, through these messages, to the next generation prompt. Rendered on its own,
    so the model's tokens before it are never re-tokenised. `last_token`: the turn's final token;
    where it is the special token the template closes the turn with, it is not written twice."""
    before = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL}]
    rendered = tokenizer.apply_chat_template(before + messages, tokenize=False, add_generation_prompt=True)
    tail = rendered[rendered.rindex(SENTINEL) + len(SENTINEL) :]
    if last_token is not None and last_token in tokenizer.all_special_ids:
        tail = tail.removeprefix(tokenizer.convert_ids_to_tokens(last_token))
    return tokenizer.encode(tail, add_special_tokens=False)


@dataclass
class PromptShard:
    """The prompts of one generate call on one worker, with their tasks (answer and metadata, what an
    environment is reset on); prompt k's global index is first_index + k."""

    prompts: list[Prompt]
    tasks: list[dict]
    first_index: int = 0


@dataclass
class EpisodeSeeds:
    """Where an episode's random draws come from: `sampling(prompt index)` is a prompt's sampling seed
    (its samples' engine calls derive theirs from it), `env(prompt index, sample)` seeds the reset of
    that sample's environment."""

    sampling: Callable[[int], int]
    env: Callable[[int, int], int]


def start_episodes(
    factory: Callable[[], Any],
    shard: PromptShard,
    samples: int,
    seeds: EpisodeSeeds,
    tokenizer,
    cfg: RolloutConfig,
    timeout_s: float,
):
    """`samples` episodes per prompt, each with its own environment reset on the prompt's task and on
    its env seed. A prompt whose reset fails (raises, hangs) or whose first prompt cannot be used is
    skipped, with the reason, as an unusable data prompt is. Returns (episodes, skipped)."""
    prompts, tasks, first_index = shard.prompts, shard.tasks, shard.first_index
    envs = [factory() for _ in range(len(prompts) * samples)]
    calls = [
        (
            env.reset,
            (
                {"prompt": prompts[i // samples], **tasks[i // samples]},
                seeds.env(first_index + i // samples, i % samples),
            ),
        )
        for i, env in enumerate(envs)
    ]
    outcomes = call_all(calls, timeout_s)
    episodes, skipped = [], []
    for offset, prompt in enumerate(prompts):
        index, mine = first_index + offset, outcomes[offset * samples : (offset + 1) * samples]
        failed = next((f"environment reset: {failure}: {value}" for failure, value in mine if failure), "")
        encoded = (
            []
            if failed
            else [
                encode_prompt(tokenizer, prompt if first is None else first, cfg.max_prompt_tokens, cfg.prompt_overflow)
                for _, first in mine
            ]
        )
        reason = failed or next((why for ids, why in encoded if ids is None), "")
        if reason:
            log.warning("rollout: skipping prompt %d: %s", index, reason)
            skipped.append((index, reason))
            continue
        episodes += [
            Episode(index, ids, envs[offset * samples + k], seeds.sampling(index) + k * 100_003)
            for k, (ids, _) in enumerate(encoded)
        ]
    return episodes, skipped


async def play(
    engine, tokenizer, episodes: list[Episode], sampling: SamplingConfig, greedy: bool, env: EnvConfig, max_tokens: int
) -> None:
    """Up to env.max_turns turns of every episode: all live episodes' turns in one call of `engine`
    (rollout.async_engine.AsyncEngine), then all their environment steps at once under the step
    deadline, in a thread (the worker's event loop serves other calls meanwhile)."""
    one = dataclasses.replace(sampling, n_samples_per_prompt=1)
    for turn in range(env.max_turns):
        live = [e for e in episodes if not e.done]
        if not live:
            break
        params = [
            sampling_params(
                one,
                (e.seed + turn * 7_919) % (2**31 - 1),
                greedy,
                min(sampling.max_new_tokens, max_tokens - len(e.ids)),
            )
            for e in live
        ]
        outputs = await engine.generate([e.prompt_ids + e.ids for e in live], params)
        actions = [take_turn(e, out.outputs[0], tokenizer, max_tokens, p) for e, out, p in zip(live, outputs, params)]
        steps = [(e.env.step, (a,)) for e, a in zip(live, actions)]
        outcomes = await asyncio.to_thread(call_all, steps, env.step_timeout_s)
        for e, outcome in zip(live, outcomes):
            observe(e, step_result(outcome), tokenizer, env.observation_role, max_tokens, turn == env.max_turns - 1)


def take_turn(e: Episode, completion, tokenizer, max_tokens: int, params) -> str:
    """Append the turn's sampled tokens and logprobs; return its text for the environment."""
    tokens = list(completion.token_ids)
    e.ids += tokens
    e.action_mask += [1] * len(tokens)
    e.logprobs += sampled_logprobs(completion)
    e.versions += token_versions(completion)
    e.turns += 1
    e.clipped_turns += completion.finish_reason == "length"
    e.last_text = completion_text(completion, tokenizer, params)
    if completion.finish_reason == "length" and len(e.ids) >= max_tokens:
        e.finish = "length"
    return e.last_text


def observe(e: Episode, result, tokenizer, role: str, max_tokens: int, last_turn: bool) -> None:
    """The environment's answer: a failure ends the episode (its return is void); else add the
    reward, and the observation's tokens if the episode continues (turns left, and room for one)."""
    if result.failure:
        log.warning("rollout: environment %s in episode of prompt %d: %s", result.failure, e.index, result.message)
        e.done, e.failure = True, result.failure
        return
    e.ret += result.reward
    if result.done:
        e.done = True
        return
    if e.finish == "length" or last_turn:  # out of tokens or turns: the return stands as the environment left it
        e.done, e.finish = True, e.finish if e.finish == "length" else "turns"
        return
    obs = observation_ids(tokenizer, result.observation or "", role, e.ids[-1] if e.ids else None)
    if len(e.ids) + len(obs) >= max_tokens:
        e.done, e.finish = True, "length"
        return
    e.ids += obs
    e.action_mask += [0] * len(obs)
    e.logprobs += [0.0] * len(obs)
    e.versions += [e.versions[-1] if e.versions else 0] * len(obs)


def to_batch(episodes: list[Episode], skipped: list[tuple[int, str]]) -> RolloutBatch:
    batch = RolloutBatch([], [], [], [], [], [], skipped)
    for e in episodes:
        batch.prompt_index.append(e.index)
        batch.prompt_ids.append(e.prompt_ids)
        batch.response_ids.append(e.ids)
        batch.logprobs.append(e.logprobs)
        batch.token_versions.append(e.versions)
        batch.finish_reason.append(e.finish)
        batch.action_mask.append(e.action_mask)
        batch.env_return.append(None if e.failure else e.ret)
        batch.turns.append(e.turns)
        batch.env_failure.append(e.failure)
        batch.clipped_turns.append(e.clipped_turns)
        batch.response_text.append(e.last_text)  # the model's own words: a tool's printed answer is not its answer
    return batch
