"""ScoringPool: the scoring service as the trainer sees it. It keeps a copy of the service's state
(the running reward normaliser) after every call, so when the actor dies and Ray restarts it
(max_restarts) the pool gives the new one that state and retries the call once: a restart changes
no reward. Evaluation goes through the read-only `evaluate`, which never changes that state."""
from __future__ import annotations

import logging

import ray

from reward_service.config import RewardConfig
from reward_service.service import ScoringService
from rollout.pool import await_ready

log = logging.getLogger(__name__)


class ScoringPool:
    def __init__(self, cfg: RewardConfig, reference_path: str, dtype: str, threads: int, chunk_tokens: int,
                 options: dict):
        """options: the actor's Ray options (resources, placement, runtime_env, max_restarts)."""
        self.actor = ray.remote(ScoringService).options(**options).remote(cfg, reference_path, dtype, threads,
                                                                           chunk_tokens)
        self.state = ray.get(self.actor.state_dict.remote())
        self.restarts = 0

    def score(self, batch, metadata: list[dict], temperature: float):
        return self._call(lambda: self.actor.score.remote(batch, metadata, temperature))

    def evaluate(self, batch, metadata: list[dict], temperature: float, with_reference: bool):
        return self._call(lambda: self.actor.evaluate.remote(batch, metadata, temperature, with_reference))

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        ray.get(self.actor.load_state_dict.remote(state))
        self.state = state

    def _call(self, call):
        def once():
            result, self.state = ray.get([call(), self.actor.state_dict.remote()])
            return result

        try:
            return once()
        except ray.exceptions.RayActorError as e:
            self.restarts += 1
            log.warning("scoring service died (%s); waiting for its restart and retrying", type(e).__name__)
            await_ready([self.actor])
            ray.get(self.actor.load_state_dict.remote(self.state))
            return once()

    def shutdown(self) -> None:
        ray.kill(self.actor)

