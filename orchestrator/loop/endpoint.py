"""Training an agent program on its own calls: the endpoint (rollout/gateway.py) beside the engines,
and the batches of its finished episodes that replace data prompts."""

from __future__ import annotations

import ray

from rollout.config import RolloutConfig
from rollout.gateway import Gateway
from rollout.types import RolloutBatch
from runtime import watchdog
from runtime.endpoint_auth import ENDPOINT_KEY_ENV, env_key


def start_gateway(workers: list, model_path: str, cfg: RolloutConfig):
    """The endpoint's actor, serving on the engines `workers`; prints where agents reach it. Its key is
    the driver's RELAY_ENDPOINT_KEY, handed to the actor (which may run on a node without it)."""
    key = env_key(ENDPOINT_KEY_ENV)
    actor = ray.remote(num_cpus=0)(Gateway).remote(
        workers, model_path, cfg.endpoint, cfg.sampling, cfg.max_prompt_tokens, cfg.max_model_len, key
    )
    url = watchdog.get(actor.url.remote())
    print(
        f"relay: agent endpoint on {url}: point an OpenAI client at {url}/episodes/<episode id>/v1, then end the "
        f'episode with POST {url}/episodes/<episode id>/reward {{"reward": r}}'
        + (f"; every call sends the key in {ENDPOINT_KEY_ENV} as `Authorization: Bearer <key>`" if key else ""),
        flush=True,
    )
    return actor


def endpoint_batch(
    gateway, samples: int, timeout_s: float, step: int
) -> tuple[RolloutBatch, list[dict], dict[str, float]]:
    """Exactly `samples` samples of finished episodes within the staleness bound at `step`, one prompt
    each (their reward is the environment source's), the examples the scoring reads for them, and
    the endpoint's counters."""
    # its own deadline: the gateway answers within timeout_s (rollout.endpoint.wait_timeout_s), naming what
    # it waited for; an agent program may legitimately take longer than the measured phases would allow
    batch, counts = ray.get(gateway.take.remote(samples, timeout_s, step), timeout=timeout_s + 120.0)
    examples = [{"prompt": "", "answer": "", "metadata": {}} for _ in range(len(batch))]
    return batch, examples, counts
