"""RolloutPool: N RolloutWorker actors behind one generate() call; scaling is a config number, or a range
(an elastic pool: engines join as nodes with room arrive, and leave with their nodes). PoolOptions: how its
actors are started and placed."""

from __future__ import annotations

import dataclasses
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import ray

from envs.config import EnvConfig
from rollout.async_engine import EngineRestarted
from rollout.config import RolloutConfig, SamplingConfig
from rollout.engine import engine_env, transfer_backend
from rollout.members import Members
from rollout.types import Prompt, RolloutBatch
from rollout.weight_sync import GLOO_BACKEND, GroupAddress, TensorMeta, init_info, update_info
from rollout.worker import RolloutWorker
from runtime import watchdog
from runtime.actors import actor_options, busy_seconds, died_among, restart_count
from runtime.device import cpu_cores, malloc_env


def sync_ranks(num_workers: int, tensor_parallel_size: int) -> tuple[int, list[int]]:
    """Weight-sync group layout: rank 0 is the sender; engine i's TP workers hold ranks
    first_rank[i] .. first_rank[i] + tp - 1, since every TP worker receives the full tensors and
    loads its own shard. Returns (world size, first rank of each engine)."""
    return 1 + num_workers * tensor_parallel_size, [1 + i * tensor_parallel_size for i in range(num_workers)]


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` contiguous shards of n items, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass
class PoolOptions:
    """How a pool's worker actors are started and placed, beside what they run (the rollout config,
    the model): the same for every worker of the pool."""

    num_cpus: float = 1.0
    """Ray CPUs each worker reserves"""
    num_gpus: float = 0.0
    """Ray GPUs each worker reserves (0: the engines run on the CPU)"""
    max_restarts: int = 0
    """how often Ray restarts a worker that died"""
    sleep_mode: bool = False
    """engines that can sleep (a learner colocated on their GPUs updates meanwhile)"""
    scheduling: list | None = None
    """per-worker Ray scheduling strategies (placement-group bundles)"""
    resources: dict[str, float] | None = None
    """custom Ray resources each worker requires (e.g. {"rollout_node": 1})"""
    step_samples: int = 0
    """samples of one training step (sizes the engines' batch, rollout.engine.engine_batch)"""
    keep_freed_memory: bool = False
    """see runtime.device.malloc_env"""
    max_workers: int = 0
    """an elastic pool's most engines (0: as many as it starts with, fixed); see RolloutPool.admit"""
    lora_rank: int = 0
    """the engines serve LoRA adapters of this rank on the base weights (learner.lora.sync adapter); 0: none"""


class RolloutPool:
    """The rollout side as the trainer sees it: it owns the N RolloutWorker actors (one vLLM engine
    each), shards every generate call over them and gathers the batch in prompt order, the engines'
    device and weight-sync backend, their side of the sync group, and their sleep/wake."""

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        num_workers: int,
        seed: int,
        options: PoolOptions | None = None,
        env: EnvConfig | None = None,
    ):
        """`options`: how the workers are started and placed (PoolOptions' defaults when None);
        env: the environment samples play (episodes)."""
        options = options or PoolOptions()
        self.model_path = model_path
        self.tensor_parallel_size = cfg.tensor_parallel_size
        threads = cfg.cpu_threads or max(1, cpu_cores() // num_workers)
        env_vars = engine_env(cfg, threads, gpu=options.num_gpus > 0) | malloc_env(
            options.keep_freed_memory, options.num_gpus > 0, threaded=True
        )
        # an elastic pool's engines are replaced, never restarted (rollout/members.py)
        restarts = 0 if options.max_workers > num_workers else options.max_restarts
        ray_options = actor_options(options.num_cpus, options.num_gpus, restarts, env_vars, options.resources)
        # an async actor (its methods are coroutines): calls share the engine, busy_seconds answers mid-generate
        actor = ray.remote(RolloutWorker)
        share = -(-options.step_samples // num_workers)
        args = (cfg, model_path, seed, threads, options.sleep_mode, share, env, options.lora_rank)
        self.adapters = options.lora_rank > 0  # weight syncs send the adapter alone (receive_adapter)
        self.workers = [
            actor.options(
                **ray_options, **({"scheduling_strategy": options.scheduling[i]} if options.scheduling else {})
            ).remote(*args)
            for i in range(num_workers)
        ]
        # the order of calls against weight syncs (rollout/async_engine.py): syncs sent so far, and each
        # engine's calls sent since the last one
        self.serial, self.calls_since_sync = 0, [0] * num_workers
        watchdog.get([w.ready.remote() for w in self.workers])

        def start():  # one more engine of an elastic pool, placed wherever a node has room
            return actor.options(**ray_options).remote(*args)

        self.members = Members(self, start, num_workers, options.max_workers, options.max_restarts)
        # the engines' own device decision (runtime.device), and the weight-transfer backend it implies
        self.device = watchdog.get(self.workers[0].get_device.remote())
        self.sync_backend = transfer_backend(self.device.type == "cuda", options.sleep_mode)

    def __len__(self) -> int:
        return len(self.workers)

    def generate(
        self,
        prompts: list[Prompt],
        step: int,
        greedy: bool = False,
        sampling: SamplingConfig | None = None,
        tasks: list[dict] | None = None,
        draw: int = 0,
    ) -> RolloutBatch:
        """Shard prompts contiguously over the workers, launch all, gather once, in prompt order."""
        return self.collect(self.submit(prompts, step, greedy, sampling, tasks, draw))

    def submit(
        self,
        prompts: list[Prompt],
        step: int,
        greedy: bool = False,
        sampling: SamplingConfig | None = None,
        tasks: list[dict] | None = None,
        draw: int = 0,
    ) -> list:
        """Launch generate() and return its pending shards (for collect). Each engine runs its calls
        in order, so weights sent after this reach it after these samples: asynchronous training
        queues generation ahead this way. `tasks`: each prompt's answer and metadata, for episodes;
        (step, draw, prompt index) seeds each request (runtime.seeds.request_seed)."""
        shards = self._shards(len(prompts))
        return [
            self.workers[i].generate.remote(
                prompts[s:e], step, s, greedy, sampling, tasks[s:e] if tasks is not None else None, draw, self.serial
            )
            for i, s, e in shards
        ]

    def preempt(self) -> int:
        """Cut every engine's running samples where they are (RolloutWorker.preempt): the calls in flight
        return at once, their unfinished samples "partial". Returns the requests cut."""
        return sum(watchdog.get([w.preempt.remote() for w in self.workers], "RolloutWorker.preempt"))

    def submit_resume(self, batch: RolloutBatch, rows: list[int], step: int, draw: int) -> list:
        """Launch the continuation of the batch's cut samples `rows` (RolloutWorker.resume), spread
        over the engines; collect() gives one continuation per row, in order."""
        # each row's place in its prompt's group of the batch: with the prompt, it seeds the continuation,
        # whichever engine takes it and however many there are
        seen, place = Counter(), []
        for index in batch.prompt_index:
            place.append(seen[index])
            seen[index] += 1
        cut = [(batch.prompt_index[i], place[i], batch.prompt_ids[i], batch.response_ids[i]) for i in rows]
        return [self.workers[i].resume.remote(cut[s:e], step, draw, self.serial) for i, s, e in self._shards(len(cut))]

    def _shards(self, n: int) -> list[tuple[int, int, int]]:
        """(engine, start, end) of n items spread contiguously over the engines (none empty), each
        engine's call counted against the next sync (sync_order)."""
        shards = [(i, s, e) for i, (s, e) in enumerate(split_evenly(n, len(self.workers))) if e > s]
        for i, _, _ in shards:
            self.calls_since_sync[i] += 1
        return shards

    @staticmethod
    def collect(pending: list) -> RolloutBatch:
        """The batch of submit's (or submit_resume's) pending calls, in order. A call that reached an
        engine Ray restarted fails as that engine's death (RayActorError), which the callers' restart
        paths handle."""
        return RolloutBatch.concat(RolloutPool.collect_engines(pending, "RolloutWorker.generate"))

    @staticmethod
    def collect_engines(pending: list, what: str) -> list:
        """The engines' answers to `pending`; one Ray restarted since fails as its death (RayActorError)."""
        try:
            return watchdog.get(pending, what)
        except ray.exceptions.RayTaskError as e:
            if not isinstance(e.cause, EngineRestarted):
                raise
            raise ray.exceptions.RayActorError(e.cause.actor_id, str(e.cause)) from e

    def lost(self, error: BaseException) -> bool:
        """Whether `error` (ray.exceptions.RayActorError) reports one of this pool's engines dead or unreachable,
        or one that left the pool (a call still pending on it fails later)."""
        return died_among(error, self.workers) or getattr(error, "actor_id", None) in self.members.departed

    def restart_counts(self) -> list[int]:
        """How often Ray has restarted each engine (a killed one shows here before its calls fail)."""
        return [restart_count(w) for w in self.workers]

    def busy_seconds(self) -> dict[str, float]:
        """Each engine's seconds spent generating since it (re)started (see busy_seconds), by actor id: the
        members of an elastic pool change between two readings."""
        return {w._actor_id.hex(): b for w, b in zip(self.workers, busy_seconds(self.workers))}

    @property
    def elastic(self) -> bool:
        return self.members.elastic

    def admit(self) -> int:
        """The engines started where a node had room, ready now: members from here on (Members.admit). The
        caller then rebuilds the sync group (init_weight_sync with keep_order) and syncs, before any call."""
        return self.members.admit()

    def prune(self, timeout_s: float = 300.0) -> int:
        """Drop the engines that died or whose node left (Members.prune); the caller rebuilds the sync group
        and launches again what they held. Returns how many left."""
        return self.members.prune(timeout_s)

    def recover(self, timeout_s: float = 300.0) -> int:
        """After an engine died: every engine answers again (Ray restarts it); an elastic pool drops the dead
        instead, and waits for joining ones while below its min (Members.recover). Returns how many left."""
        return self.members.recover(timeout_s)

    def failed_since(self, restarts: list[int]) -> bool:
        """Whether an engine died since restart_counts() gave `restarts`: Ray restarted one, or (an elastic
        pool's, never restarted) one is dead or gone with its node."""
        return self.restart_counts() != restarts or (self.elastic and bool(self.members.gone_members()))

    @property
    def sync_world_size(self) -> int:
        return sync_ranks(len(self.workers), self.tensor_parallel_size)[0]

    def init_weight_sync(
        self, host: str, port: int, timeout_s: float = 300.0, bucket_bytes: int = 64 << 20, keep_order: bool = False
    ) -> list:
        """Start every engine's side of the transfer (ranks 1..sync_world_size-1 of the group, on
        `sync_backend`); the sender must join as rank 0 while these are pending. host:port is the
        sender's store (learner rank 0's node IP and a port free there); bucket_bytes: nccl's
        packed chunk, as the sender's. keep_order: the members grew, and the calls sent so far still run
        (the next sync waits for them as ever). Returns the futures to wait on after the sender has joined."""
        world, first = sync_ranks(len(self.workers), self.tensor_parallel_size)
        if not keep_order:
            self.forget_calls()
        return [
            w.init_weight_sync.remote(
                init_info(self.sync_backend, GroupAddress(host, port, r, world, timeout_s, bucket_bytes))
            )
            for w, r in zip(self.workers, first)
        ]

    def forget_calls(self) -> None:
        """A new sync group after a restart: the calls sent before it either died with their engine or are
        generated again, so no sync waits for them."""
        self.calls_since_sync = [0] * len(self.workers)

    def receive_weights(self, buckets: list[list[TensorMeta]], version: int | None = None, in_flight=False) -> list:
        """Start every worker's receive of policy `version`, between its calls or in flight (mid-sequence);
        the sender broadcasts while these are pending."""
        return self.take_update(update_info(self.sync_backend, buckets), version, in_flight)

    def take_update(self, info: dict, version: int | None = None, in_flight: bool = False) -> list:
        """Start every worker's update from `info` (an update_info of `sync_backend`; IPC's comes
        from the sender) as policy `version`."""
        return [
            w.receive_weights.remote(info, version, in_flight, order)
            for w, order in zip(self.workers, self.sync_order())
        ]

    def receive_adapter(self, adapter, version: int | None = None, in_flight: bool = False) -> list:
        """Start every worker's load of `adapter` (a pending learner call: Ray hands each engine its result)
        as policy `version`, in the calls' order as receive_weights."""
        return [
            w.load_adapter.remote(adapter, version, in_flight, order)
            for w, order in zip(self.workers, self.sync_order())
        ]

    def sync_order(self) -> list[tuple[int, int]]:
        """Number the next sync: (its serial, the calls sent to each engine since the one before)."""
        self.serial += 1
        order, self.calls_since_sync = [(self.serial, n) for n in self.calls_since_sync], [0] * len(self.workers)
        return order

    def wire_plan(self, buckets: list[list[TensorMeta]]) -> list[list[TensorMeta]]:
        """`buckets` with every tensor the engines store transposed marked to travel so (GPT-2's
        Conv1D weights: a transposed copy runs at ~1/8 the speed of a plain one on CPU, and the
        sender then does it once, in the time it waits for the engines anyway). The engines learn
        their layout on the first sync, so call this after one; all hold the same model. Only relay's
        gloo engine copies directly: vLLM's own take the tensors in Hugging Face layout."""
        if self.sync_backend != GLOO_BACKEND:
            return buckets
        routes = watchdog.get(self.workers[0].weight_routes.remote())
        return [
            [dataclasses.replace(m, transposed=m.name in routes and routes[m.name][2]) for m in bucket]
            for bucket in buckets
        ]

    def load_weights(self, named_tensors) -> list[int]:
        ref = ray.put(named_tensors)  # one copy in the object store, read by every worker
        return watchdog.get(
            [w.load_weights.remote(ref, None, False, o) for w, o in zip(self.workers, self.sync_order())]
        )

    def probe_ids(self) -> list[int]:
        return watchdog.get(self.workers[0].probe_ids.remote(), "sync check")

    def probe(self, ids: list[int], engines: list | None = None) -> list[list[float]]:
        """Each engine's logprobs of the probe `ids` (the sync check, rollout/sync_check.py): every member, or
        those of `engines` still members. An engine Ray restarted since fails as its death (RayActorError)."""
        members = [w for w in self.workers if engines is None or w in engines]
        return self.collect_engines([w.probe.remote(ids) for w in members], "sync check")

    def weight_checksums(self) -> list[float]:
        return watchdog.get([w.weight_checksum.remote() for w in self.workers])

    def sleep(self) -> int:
        """Every engine asleep (GPU: weights offloaded, KV cache freed); returns the bytes freed."""
        return sum(watchdog.get([w.sleep.remote() for w in self.workers]))

    def wake_up(self) -> None:
        watchdog.get([w.wake_up.remote() for w in self.workers])

    @contextmanager
    def asleep(self, enabled: bool):
        """The engines asleep inside the block when `enabled` (a learner colocated on their GPUs
        updates there), awake again at its end, before the weight sync that needs their memory."""
        if not enabled:
            yield
            return
        with watchdog.phase("sleep"):
            self.sleep()
        try:
            yield
        finally:
            with watchdog.phase("wake"):
                self.wake_up()

    def shutdown(self, timeout_s: float = 20.0) -> None:
        """Ask each engine to stop, then end the actors whatever they answered: a wedged engine
        must not hang the run's exit."""
        ray.wait([w.shutdown.remote() for w in self.workers], num_returns=len(self.workers), timeout=timeout_s)
        for w in self.workers + self.members.stop_joining():
            ray.kill(w)
        self.workers = []
