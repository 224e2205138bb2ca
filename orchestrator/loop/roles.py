"""The roles of a training run as the loop sees them: Ray started, every role built where it runs
(placement bundles, thread split, malloc environment), the weight sync, a rollout restart, and the
shutdown."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

import ray

from learner.group import LearnerGroup, RankPlacement
from learner.precision import policy_function
from orchestrator.config.schema import TrainConfig
from orchestrator.loop.endpoint import start_gateway
from orchestrator.loop.placement import RoleBundles, cpu_threads, one_unit_of, placement
from orchestrator.tools.suites import suite_sources
from reward_service.pool import ScoringPool
from rollout.adapters import refuse_unservable
from rollout.channel import WeightChannel
from rollout.pool import PoolOptions, RolloutPool
from rollout.sync_check import SyncCheck
from runtime import watchdog
from runtime.device import malloc_env
from runtime.endpoint_auth import REWARD_KEY_ENV, env_key
from runtime.logprobs import SamplerSettings

log = logging.getLogger(__name__)


def init_ray(cfg: TrainConfig) -> None:
    """Join the cluster at cluster.address (or start a local one), unless this process already has."""
    if not ray.is_initialized():
        ray.init(address=cfg.cluster.address or None, include_dashboard=False, log_to_driver=False)


def learner_algorithm(cfg: TrainConfig):
    """The algorithm section the learner runs: loss_norm_tokens 0 resolved to the budget of the
    longest sample this run can make (seq_sum_norm's constant): one response, an episode's model
    and observation tokens, or an endpoint conversation (at most rollout.max_model_len)."""
    a, r = cfg.algorithm, cfg.rollout
    budget = r.max_model_len if r.endpoint.enabled else cfg.env.response_tokens(r.sampling.max_new_tokens)
    return dataclasses.replace(a, loss_norm_tokens=a.loss_norm_tokens or budget)


@dataclasses.dataclass
class RolePlacement:
    """Where the actors of each role go and with how many threads: the placement group's RoleBundles
    (None: no bundles, each actor asks for a unit of its role's custom resource), the torch threads
    of (rollout, learner, scoring) (placement.cpu_threads), and whether the engines sleep while the
    learner updates on their GPUs."""

    bundles: RoleBundles | None
    threads: tuple[int, int, int]
    sleep_engines: bool

    def cpus(self) -> int:
        return 1 if self.bundles else 0  # colocated actors reserve no CPU: they take turns

    def resources(self, resource: str) -> dict | None:
        return one_unit_of(resource) if self.bundles is None else None


def start_roles(cfg: TrainConfig, model_path: str) -> Roles:
    """Every role of the run, built in its placement: rollout pool, scoring pool, learner group, the
    weight channel between them, and the agent endpoint when enabled."""
    c = cfg.cluster
    placement_group, bundles = placement(c)
    # engines and learner on the same GPUs: vLLM sleeps during the update (sleep_engines)
    where = RolePlacement(
        bundles, cpu_threads(cfg), c.colocate and c.gpus_per_rollout_worker > 0 and c.gpus_per_learner > 0
    )
    rollout = start_rollout(cfg, model_path, where)
    scoring = start_scoring(cfg, model_path, where)
    learner = start_learner(cfg, model_path, where)
    in_flight = cfg.async_training.mode.value == "in_flight"
    check = SyncCheck.of(cfg.rollout, lora_sync(cfg.learner))
    channel = WeightChannel(
        rollout, learner, cfg.rollout.sync_bucket_mb, cfg.watchdog.collective_timeout_s, in_flight, check
    )
    gateway = start_gateway(rollout.workers, model_path, cfg.rollout) if cfg.rollout.endpoint.enabled else None
    return Roles(rollout, scoring, learner, channel, gateway, placement_group, where.sleep_engines)


LORA_SYNC = {
    "adapter": "the adapter alone, which vLLM's LoRA applies to the base weights the engines loaded once",
    "merged": "the whole model with the adapter merged in, at every sync",
}


LORA_REFERENCE = {
    "learner": "the learner's base weights with the adapter disabled; the scoring service loads no copy of them "
    "(learner.lora.reference learner)",
    "scoring": "the scoring service's own copy of the base, computed behind the generation "
    "(learner.lora.reference scoring)",
}


def lora_sync(learner_cfg) -> str:
    """What a LoRA run's weight syncs send (learner.lora.sync: "adapter" or "merged"); "" without LoRA."""
    lora = learner_cfg.lora
    sync = str(getattr(lora.sync, "value", lora.sync)) if lora.rank > 0 else ""
    if sync == "auto":  # start_parts resolves it (orchestrator/config/lora.py)
        raise ValueError("learner.lora.sync auto: not resolved to adapter or merged before the roles start")
    return sync


def start_rollout(cfg: TrainConfig, model_path: str, where: RolePlacement) -> RolloutPool:
    """The rollout pool: cluster.engines engines, in their bundles, or (an elastic pool, whose engines no
    bundle holds) each asking the cluster for its CPU, GPUs and rollout resource, up to cluster.max_engines."""
    c, sync = cfg.cluster, lora_sync(cfg.learner)
    if sync == "adapter":
        refuse_unservable(model_path, list(cfg.learner.lora.target_modules))
    if sync:
        print(f"relay: LoRA weight sync: {LORA_SYNC[sync]} (learner.lora.sync {sync})", flush=True)
        where_ref = cfg.learner.lora.reference
        print(f"relay: LoRA reference: {LORA_REFERENCE[str(getattr(where_ref, 'value', where_ref))]}", flush=True)
    return RolloutPool(
        dataclasses.replace(cfg.rollout, cpu_threads=where.threads[0]),
        model_path,
        c.engines,
        cfg.seed,
        PoolOptions(
            num_cpus=where.cpus(),
            num_gpus=c.gpus_per_rollout_worker,
            max_restarts=c.max_restarts,
            sleep_mode=where.sleep_engines,
            scheduling=where.bundles.rollout if where.bundles else None,
            resources=one_unit_of(c.rollout_resource) if c.elastic else where.resources(c.rollout_resource),
            max_workers=c.max_engines,
            step_samples=cfg.data.rollout_batch_size * cfg.rollout.sampling.n_samples_per_prompt,
            keep_freed_memory=c.cpu_keep_freed_memory,
            lora_rank=cfg.learner.lora.rank if lora_sync(cfg.learner) == "adapter" else 0,
        ),
        env=cfg.env,
    )


def start_scoring(cfg: TrainConfig, model_path: str, where: RolePlacement) -> ScoringPool:
    c = cfg.cluster
    env = malloc_env(c.cpu_keep_freed_memory, c.gpus_per_scoring > 0, threaded=True)
    if env_key(REWARD_KEY_ENV):  # a remote source's key, to the scoring actor on whichever node it lands
        env[REWARD_KEY_ENV] = env_key(REWARD_KEY_ENV)
    return ScoringPool(
        cfg.reward,
        model_path,
        policy_function(cfg.learner),
        where.threads[2],
        dict(
            num_cpus=where.cpus(),
            num_gpus=c.gpus_per_scoring,
            max_restarts=c.max_restarts,
            resources=where.resources(c.scoring_resource) or {},
            runtime_env={"env_vars": env},
            **({"scheduling_strategy": where.bundles.scoring} if where.bundles else {}),
        ),
        suite_sources(cfg),
        reference=not cfg.learner.lora.reference_in_learner,
    )


def start_learner(cfg: TrainConfig, model_path: str, where: RolePlacement) -> LearnerGroup:
    c = cfg.cluster
    return LearnerGroup(
        dataclasses.replace(cfg.learner, model_path=model_path, threads=where.threads[1]),
        learner_algorithm(cfg),
        SamplerSettings.of(cfg.rollout.sampling),
        c.learner_ranks,
        cfg.seed,
        RankPlacement(
            num_cpus=where.cpus(),
            num_gpus=c.gpus_per_learner,
            scheduling=where.bundles.learner if where.bundles else None,
            resources=where.resources(c.learner_resource),
        ),
        keep_freed_memory=c.cpu_keep_freed_memory,
        collective_timeout_s=cfg.watchdog.collective_timeout_s,
    )


class Roles:
    """Owns every actor of the run: the rollout pool (and the agent endpoint in front of it), the
    scoring pool, the learner group, the weight channel between learner and engines, and the
    placement group they sit in (start_roles builds them); counts the rollout and learner restarts it recovered from."""

    def __init__(
        self, rollout, scoring, learner, channel, gateway=None, placement_group=None, sleep_engines: bool = False
    ):
        self.rollout, self.scoring, self.learner, self.channel = rollout, scoring, learner, channel
        self.gateway, self.placement_group, self.sleep_engines = gateway, placement_group, sleep_engines
        self.rollout_restarts = 0
        self.learner_restarts = 0  # learner group rebuilds (Trainer.recover_learner)

    # ------------------------------------------------------------------ during the run
    def actors(self) -> dict:
        """Every actor by role name (rollout_i, scoring, learner_i)."""
        return (
            {f"rollout_{i}": w for i, w in enumerate(self.rollout.workers)}
            | {"scoring": self.scoring.actor}
            | {f"learner_{i}": r for i, r in enumerate(self.learner.ranks)}
        )

    def busy(self) -> dict[str, list[float]]:
        """Each role's seconds of work so far, by actor (step_metrics.busy_metrics)."""
        with watchdog.phase("busy"):
            return {"rollout": self.rollout.busy_seconds(), "scoring": {"scoring": self.scoring.busy_seconds()}}

    def engines_asleep(self) -> AbstractContextManager:
        """The engines asleep for the block when they share the learner's GPUs (awake again after)."""
        return self.rollout.asleep(self.sleep_engines)

    def change_members(self, version: int, on_restart) -> None:
        """An elastic pool's changes between steps: the engines that died or whose node left dropped, those
        ready where nodes joined admitted, the sync group rebuilt with the members, and every member given
        policy `version` before a call reaches a new one. What was launched to engines that left (calls
        launched ahead) is launched again on the members (`on_restart`), as after a restart."""
        left, joined = self.rollout.prune(), self.rollout.admit()
        if not (left or joined):
            return
        log.warning("rollout engines: %d left, %d joined; %d now", left, joined, len(self.rollout))

        def regroup():  # the sync group rebuilt with the members, before the sync
            if not left:  # engines only joined: the calls sent so far still run, and the next sync waits for them
                self.channel.wait_sent()
            self.channel.connect(keep_order=not left)

        # engines left: the old group is broken, and what was in flight on them is launched again
        restarted = self.sync_weights(version, True, on_restart, first=regroup)
        if left and not restarted:
            on_restart()

    def sync_weights(self, version: int, wait: bool, on_restart, first: Callable[[], None] | None = None) -> bool:
        """The learner's weights to the engines as policy `version` (wait=False: do not wait for the
        engines; `first()` runs before, under the same recovery: change_members' regroup). If an engine died (or
        the watchdog killed a stuck one: the sender's broadcast then fails too), restart_rollout, then
        `on_restart()` (launch again what was lost). Returns whether it did."""
        restarts = self.rollout.restart_counts()
        try:
            if first is not None:
                first()
            self.channel.send(version, wait=wait)
            return False
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            if not isinstance(e, ray.exceptions.RayActorError):
                self.learner.raise_if_lost(e)  # a rank's death may reach us as its peers' failed broadcast first
            if self.learner.lost(e):  # the sender died: the loop's learner recovery, not an engine restart
                raise
            if not isinstance(e, ray.exceptions.RayActorError) and not self.rollout.failed_since(restarts):
                raise  # the sender failed on its own
            self.restart_rollout(e, version)
            on_restart()
            return True

    def restart_rollout(self, error: Exception, version: int) -> None:
        """An engine died: wait for Ray to restart it (an elastic pool drops the dead, RolloutPool.recover),
        rebuild the weight-sync group and give every engine the learner's weights (policy `version`). What
        it was generating is the caller's to relaunch, on the engines there are."""
        self.rollout_restarts += 1
        log.warning("rollout worker died (%s); waiting for its restart and generating again", type(error).__name__)
        left = self.rollout.recover()
        if left:
            log.warning("%d rollout engine(s) dropped; %d go on", left, len(self.rollout))
        self.channel.connect()
        self.channel.send(version)

    def restart_learner(self) -> None:
        """A learner rank died: start every rank again (LearnerGroup.restart) and reconnect the weight
        channel (the new rank 0 joins a new group with the engines). Restoring the learner's state and
        giving the engines its weights is the loop's (LearnerRecovery, LoopState.load_state_dict)."""
        self.learner_restarts += 1
        self.learner.restart()
        self.rollout.prune()  # an elastic pool's dead engines (never restarted) out of the group first
        self.channel.connect()

    def finish_sync(self) -> None:
        """Wait for a weight sync still in flight."""
        with watchdog.phase("sync"):
            self.channel.wait_sent()

    def shutdown(self) -> None:
        if self.gateway is not None:
            ray.wait([self.gateway.shutdown.remote()], timeout=20.0)  # a wedged gateway must not hang the exit
        self.rollout.shutdown()
        self.learner.shutdown()
        self.scoring.shutdown()
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
