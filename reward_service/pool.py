"""ScoringPool: the scoring service as the trainer sees it. It keeps a copy of the service's state
(the running reward normaliser, the judges' verdict caches) after every call, so when the actor dies and Ray restarts it
(max_restarts) the pool gives the new one that state and retries the call once: a restart changes
no reward. Evaluation (`evaluate`) changes no reward state; its judges' verdicts join their caches."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray

from reward_service.config import RewardConfig
from reward_service.service import ScoringService
from runtime import watchdog
from runtime.actors import await_ready, busy_seconds
from runtime.forward import PolicyFunction

log = logging.getLogger(__name__)


class Restarted(Exception):
    """The scoring actor answering is not the one the pool gave its state to."""


@dataclass
class ScoringAhead:
    """A batch's scoring launched behind its generation: its judge call, its reference call, and the
    actor instance that took them."""

    judged: ray.ObjectRef
    reference: ray.ObjectRef | None  # None: the learner computes the reference
    instance: str


class ScoringPool:
    """The scoring service as the trainer sees it: it owns the service's actor, the copy of its state
    taken after every call, and the restarts it has recovered from (see the module docstring)."""

    def __init__(
        self,
        cfg: RewardConfig,
        reference_path: str,
        function: PolicyFunction,
        threads: int,
        options: dict,
        suites: dict[str, list] | None = None,
        reference: bool = True,
    ):
        """function: the learner's forward (ScoringService); options: the actor's Ray options (resources,
        placement, runtime_env, max_restarts); suites: the evaluation suites' own reward sources (ScoringService);
        reference False: the learner computes the reference (ScoringService)."""
        # busy_seconds is answered from a concurrency group of its own, while the service judges
        remote = ray.remote(concurrency_groups={"stats": 1})(ScoringService)
        self.actor = remote.options(**options).remote(cfg, reference_path, function, threads, suites, reference)
        self.has_reference = reference
        self.state, self.instance = watchdog.get([self.actor.state_dict.remote(), self.actor.instance_id.remote()])
        self.restarts = 0

    def judge_ahead(self, pending: list, metadata: list[dict], temperature: float) -> ScoringAhead:
        """Judge the batch that the pending generate calls will make, and take its reference logprobs,
        as soon as they finish (ScoringService.judge, .reference_logprobs); for score and reference.
        The calls travel in a list, which Ray does not resolve: the service waits for them itself, as
        Ray would hold every later call of this driver to the service (it runs them in order) until
        their arguments are ready, busy_seconds too, so each step would end only once the next
        batch is generated, and a checkpoint would never find a batch ahead to cut."""
        ref = (
            self.actor.reference_logprobs.remote(list(pending), temperature=temperature) if self.has_reference else None
        )
        return ScoringAhead(
            self.actor.judge.remote(list(pending), metadata=metadata, temperature=temperature), ref, self.instance
        )

    def score(self, batch, metadata: list[dict], temperature: float, ahead: ScoringAhead | None = None):
        """The batch's rewards (ScoringService.score). ahead: its judge_ahead, so only the shaping is
        left. If the actor died since, the restarted one scores the batch whole."""
        whole = lambda: self.actor.score.remote(batch, metadata, temperature)  # noqa: E731
        return self._call((lambda: self.actor.finish.remote(ahead.judged)) if ahead is not None else whole, whole)

    def reference(self, batch, temperature: float, ahead: ScoringAhead | None = None) -> list[list[float]]:
        """The batch's reference logprobs: those judge_ahead launched, if the actor that took that call
        still serves (else a restart, already counted by `score`, lost them), or computed now. Without a reference
        here (the learner computes it: a LoRA policy's base) each sample's are empty, and no call is made."""
        if not self.has_reference:
            return [[] for _ in range(len(batch))]
        whole = lambda: self.actor.reference_logprobs.remote(batch, temperature=temperature)  # noqa: E731
        if ahead is not None and ahead.instance == self.instance:
            return self._call(lambda: ahead.reference, whole, reads_only=True)
        return self._call(whole, reads_only=True)

    def busy_seconds(self) -> float:
        """The service's seconds spent judging since it (re)started (0 while Ray restarts it)."""
        return busy_seconds([self.actor])[0]

    def evaluate(self, batch, metadata: list[dict], temperature: float, with_reference: bool, suite: str = ""):
        # not reads_only: a judge's verdicts asked in evaluation join its cache, which is state
        return self._call(lambda: self.actor.evaluate.remote(batch, metadata, temperature, with_reference, suite))

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        watchdog.get(self.actor.load_state_dict.remote(state))
        self.state = state

    def _call(self, call, retry=None, reads_only: bool = False):
        """call(), keeping the state it leaves (reads_only: a call that changes none, so nothing to keep).
        If the actor died, in the call or before it (Ray queues calls for an actor it is restarting: one
        could run on the new actor before it has the state), wait for the restart, give it the state and
        make the call again (`retry`, if given)."""

        def once(call):
            asks = [call(), self.actor.instance_id.remote()] + ([] if reads_only else [self.actor.state_dict.remote()])
            result, instance, *state = watchdog.get(asks)
            if instance != self.instance:
                raise Restarted(instance)
            if state:
                self.state = state[0]
            return result

        try:
            return once(call)
        except (ray.exceptions.RayActorError, Restarted) as e:
            self.restarts += 1
            log.warning("scoring service died (%s); waiting for its restart and retrying", type(e).__name__)
            await_ready([self.actor])
            self.instance = watchdog.get(self.actor.instance_id.remote())
            watchdog.get(self.actor.load_state_dict.remote(self.state))
            return once(retry or call)

    def shutdown(self) -> None:
        ray.kill(self.actor)
