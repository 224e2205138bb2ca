"""An environment's reset gets a seed from the run seed (review A 7): an environment that draws at random
plays other draws under another run seed, the same ones under the same seed, and its own per episode.
Through the real RolloutWorker._episodes on a scripted engine."""

import asyncio
import random
from types import SimpleNamespace

from envs.base import Environment
from envs.config import EnvConfig
from learner.tiny_gpt import DEFAULT_ALPHABET, char_tokenizer
from rollout.config import RolloutConfig, SamplingConfig

DRAWS = []


class Dice(Environment):
    """Draws its target at reset from the seed it is given, as Environment.reset documents."""

    def reset(self, task, seed):
        self.target = random.Random(seed).randint(0, 10**9)
        DRAWS.append(self.target)
        return None

    def step(self, action):
        return None, 0.0, True, {}


class Engine:
    """Stands in for rollout.async_engine.AsyncEngine."""

    version = 0

    async def generate(self, prompt_ids, params):
        done = SimpleNamespace(
            token_ids=[5], logprobs=[{5: SimpleNamespace(logprob=-0.5)}], finish_reason="stop", text=""
        )
        return [SimpleNamespace(outputs=[done]) for _ in prompt_ids]


def env_draws(run_seed: int, key=(0, 1)) -> list[int]:
    from rollout.worker import RolloutWorker  # imports vLLM: only here

    worker = object.__new__(RolloutWorker)
    sampling = SamplingConfig(max_new_tokens=4, n_samples_per_prompt=2)
    worker.seed, worker.cfg, worker.engine = run_seed, RolloutConfig(max_prompt_tokens=16), Engine()
    worker.env, worker.env_factory = EnvConfig(name="dice", max_turns=1), Dice
    worker.tokenizer = char_tokenizer(DEFAULT_ALPHABET)
    DRAWS.clear()
    asyncio.run(worker._episodes(["1+1=", "1+1="], [{"answer": "2"}] * 2, key, 0, False, sampling))
    return list(DRAWS)


def test_two_run_seeds_give_two_environment_draws_and_one_seed_the_same():
    first = env_draws(0)
    assert len(first) == 4 and len(set(first)) == 4  # every episode its own draw, also of one prompt
    assert env_draws(0) == first  # reproducible
    assert not set(env_draws(1)) & set(first)  # before: reset(task) had no seed, every run drew alike
    assert not set(env_draws(0, key=(0, 2))) & set(first)  # another batch of the step: other draws
