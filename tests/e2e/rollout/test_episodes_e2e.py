"""Multi-turn episodes on a real vLLM engine: the episode's tokens are the engine's, turn by turn;
observations are the template's tokens, masked; failing environments end only their episodes."""

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from rollout.episodes import observation_ids

pytestmark = pytest.mark.e2e
PROMPTS = ["12+34=", "7*8=", "hello"]


SAMPLES = 2  # episodes per prompt


@pytest.fixture(scope="module")
def player(ray_cluster, tiny_model):
    """One actor with one real engine for the module's episodes: its weights never change and every
    episode has its own sampling seed (only the prefix cache carries over: the tests pass in either order)."""

    class Recorder:
        def __init__(self, engine):
            self.engine, self.calls = engine, []

        async def generate(self, prompt_ids, params):
            outs = await self.engine.generate(prompt_ids, params)
            self.calls.append(
                [
                    (
                        r,
                        list(o.outputs[0].token_ids),
                        [s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                    )
                    for r, o in zip(prompt_ids, outs)
                ]
            )
            return outs

    @ray.remote(num_cpus=1)
    class Player:
        def __init__(self):
            import os

            from rollout.async_engine import AsyncEngine
            from rollout.config import RolloutConfig, SamplingConfig
            from rollout.engine import engine_env, make_engine

            self.cfg = RolloutConfig(
                max_model_len=128,
                max_prompt_tokens=16,
                sampling=SamplingConfig(max_new_tokens=6, n_samples_per_prompt=SAMPLES, seed=3),
            )
            os.environ.update(engine_env(self.cfg, 1, False))
            self.llm = make_engine(self.cfg, tiny_model, 0, torch.device("cpu"))
            self.engine = AsyncEngine(self.llm)

        async def play(self, prompts, env_classes, max_turns, budget, timeout_s):
            """One episode per (prompt, sample), env_classes[i] making prompt i's environment; the engine's
            calls recorded. Async: every call runs on the actor's one event loop, the engine's."""
            from envs.config import EnvConfig
            from rollout.episodes import EpisodeSeeds, PromptShard, play, start_episodes, to_batch

            tok, rec = self.llm.get_tokenizer(), Recorder(self.engine)
            made = iter([cls() for cls in env_classes for _ in range(SAMPLES)])
            episodes, skipped = start_episodes(
                lambda: next(made),
                PromptShard(prompts, [{"answer": "0"}] * len(prompts)),
                SAMPLES,
                EpisodeSeeds(sampling=lambda i: 100 + i, env=lambda i, k: 0),
                tok,
                self.cfg,
                timeout_s,
            )
            env = EnvConfig(name="test", max_turns=max_turns, step_timeout_s=timeout_s)
            await play(rec, tok, episodes, self.cfg.sampling, False, env, budget)
            return to_batch(episodes, skipped), rec.calls

        def shutdown(self):
            self.llm.shutdown()

    actor = Player.remote()
    yield actor
    try:
        ray.get(actor.shutdown.remote())
    finally:
        ray.kill(actor)


def play_in_actor(player, env_classes, prompts=PROMPTS, max_turns=3, budget=40, timeout_s=1.0):
    return ray.get(player.play.remote(prompts, env_classes, max_turns, budget, timeout_s))


def test_episode_tokens_are_what_the_engine_sampled_turn_by_turn(player, tiny_model):
    from envs.base import Environment

    class Counter(Environment):  # never ends by itself: every episode plays every turn
        def __init__(self):
            self.turn = 0

        def step(self, action):
            self.turn += 1
            return f"obs {self.turn}", 0.25, False, {}

    batch, calls = play_in_actor(player, [Counter] * len(PROMPTS))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert len(batch) == 6 and len(calls) == 3 and batch.turns == [3] * 6
    for i in range(len(batch)):
        ids, acts, lps = batch.response_ids[i], batch.action_mask[i], batch.logprobs[i]
        pos = 0
        for turn, call in enumerate(calls):
            prompt, sampled, sampled_lps = call[i]
            assert (
                prompt == batch.prompt_ids[i] + ids[:pos]
            )  # the engine saw the episode's own tokens, nothing re-tokenised
            assert ids[pos : pos + len(sampled)] == sampled and lps[pos : pos + len(sampled)] == sampled_lps
            assert acts[pos : pos + len(sampled)] == [1] * len(sampled)
            pos += len(sampled)
            if turn < 2:  # observations between turns; after the last turn the episode ends
                obs = observation_ids(tok, f"obs {turn + 1}", "user", sampled[-1])
                assert ids[pos : pos + len(obs)] == obs and acts[pos : pos + len(obs)] == [0] * len(obs)
                assert lps[pos : pos + len(obs)] == [0.0] * len(obs)
                pos += len(obs)
        assert pos == len(ids) and len(acts) == len(lps) == len(ids)
    assert batch.env_return == [0.75] * 6 and batch.finish_reason == ["turns"] * 6  # out of turns, not clipped
    # the learner scores the same tokens: transformers' logprobs of the model's tokens match the engine's
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        for p, r, lp, act in zip(batch.prompt_ids, batch.response_ids, batch.logprobs, batch.action_mask):
            logits = hf(torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
            model = torch.tensor(act, dtype=torch.bool)
            assert torch.allclose(torch.tensor(lp)[model], ref[model], atol=1e-4, rtol=0)


def test_a_hanging_or_raising_environment_ends_only_its_episodes(player):
    import time

    from envs.base import Environment

    class Fine(Environment):
        def step(self, action):
            return "go on", 1.0, False, {}

    class Hangs(Fine):
        def step(self, action):
            time.sleep(20)

    class Raises(Fine):
        def step(self, action):
            raise RuntimeError("boom")

    class BadReset(Fine):
        def reset(self, task, seed):
            raise KeyError("no such task")

    batch, calls = play_in_actor(player, [Fine, Hangs, Raises, BadReset], [*PROMPTS, "x"], max_turns=2, timeout_s=1.0)
    assert batch.skipped == [
        (3, "environment reset: error: KeyError: 'no such task'")
    ]  # counted, topped up by the trainer
    assert batch.prompt_index == [0, 0, 1, 1, 2, 2]
    assert batch.env_failure == ["", "", "timeout", "timeout", "error", "error"]
    assert batch.env_return == [2.0, 2.0, None, None, None, None]  # a failed episode's return is void: invalid, counted
    # only the fine ones went on; the hanging steps (20 s) were abandoned at the 1 s deadline, not waited for
    assert batch.turns == [2, 2, 1, 1, 1, 1] and len(calls) == 2 and len(calls[1]) == 2
