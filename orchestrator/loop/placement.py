"""Where the roles run: Ray placement groups (colocate: false), custom node resources, threads."""

from __future__ import annotations

from dataclasses import dataclass

import ray

from runtime.device import cpu_cores


@dataclass
class RoleBundles:
    """The scheduling strategies of each role's placement-group bundles (colocate: false), by role."""

    rollout: list | None  # one per rollout worker (None: an elastic pool)
    learner: list  # one per learner rank
    scoring: object  # the scoring service's one


def placement(c):
    """colocate: false -> one placement group with a bundle per actor (rollout workers, learner
    ranks, then the scoring service), so each role holds its own CPUs/GPUs on any number of nodes.
    colocate: true -> no group: actors reserve nothing and take turns on the same devices.
    Returns (the group or None, its RoleBundles or None)."""
    if c.colocate:
        return None, None
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    wanted = bundles(c)
    pg = placement_group(wanted, strategy="PACK")
    ray.get(pg.ready(), timeout=600)
    each = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i) for i in range(len(wanted))]
    workers = 0 if c.elastic else c.engines
    return pg, RoleBundles(rollout=None if c.elastic else each[:workers], learner=each[workers:-1], scoring=each[-1])


def bundles(c) -> list[dict[str, float]]:
    """The placement-group bundles of `colocate: false`, in placement()'s order: a CPU, the role's
    GPUs and a unit of the role's custom resource (cluster.*_resource) per actor. An elastic pool's
    engines are not in the group: each asks the cluster for the same itself, wherever a node has it."""
    roles = (
        [(c.gpus_per_rollout_worker, c.rollout_resource)] * (0 if c.elastic else c.engines)
        + [(c.gpus_per_learner, c.learner_resource)] * c.learner_ranks
        + [(c.gpus_per_scoring, c.scoring_resource)]
    )
    return [{k: v for k, v in {"CPU": 1, "GPU": gpus}.items() if v} | one_unit_of(resource) for gpus, resource in roles]


def cpu_threads(cfg) -> tuple[int, int, int]:
    """Torch threads of each rollout engine, each learner rank and the scoring service (0: the
    role's own default; rollout.cpu_threads and learner.threads, when set, win). Colocated roles
    that take turns (the sync loop) each use every core. When generation overlaps the learner
    (async_training, colocated on CPUs), the engines get half the cores and the learner ranks the
    other half: oversubscribed cores would make both sides slower than taking turns. The scoring
    service judges each batch behind its generation, while the engines wait (PromptBatches.score_next_ahead),
    so it gets the engines' half. With bundles of their own, Ray's setting (their CPUs) stands."""
    c, cores = cfg.cluster, cpu_cores()
    if not c.colocate:
        return cfg.rollout.cpu_threads, cfg.learner.threads, 0
    if cfg.async_training.mode.value == "sync" or c.gpus_per_rollout_worker > 0:
        return cfg.rollout.cpu_threads, cfg.learner.threads, cores
    rollout_cores = max(1, cores // 2)
    rest = max(1, cores - rollout_cores)
    return (
        cfg.rollout.cpu_threads or max(1, rollout_cores // c.engines),
        cfg.learner.threads or max(1, rest // c.learner_ranks),
        rollout_cores,
    )


def one_unit_of(resource: str) -> dict[str, float]:
    """One unit of a custom Ray resource ({} for ""): a node started with --resources '{"X": 8}' hosts 8 such actors."""
    return {resource: 1} if resource else {}
