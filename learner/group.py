"""LearnerGroup: the N learner ranks behind one call per phase (launch all, ray.get once)."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import ray

from learner.checkpoint import publish
from learner.config import AlgorithmConfig, LearnerConfig
from learner.engine import RankAddress
from learner.worker import Learner, node_address
from rollout.weight_sync import GroupAddress, encode_plan
from runtime import watchdog
from runtime.actors import died_among
from runtime.device import cpu_cores, malloc_env
from runtime.logprobs import SamplerSettings

log = logging.getLogger(__name__)


def rank_options(
    num_cpus: float,
    num_gpus: float,
    threads: int,
    resources: dict[str, float] | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """Ray options of one learner rank. `resources`: custom Ray resources it requires (placement knobs);
    `env`: more environment (runtime.device.malloc_env)."""
    return {
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "resources": dict(resources or {}),
        "runtime_env": {
            "env_vars": {
                "DS_ACCELERATOR": "cpu" if not num_gpus else "cuda",
                "OMP_NUM_THREADS": str(threads),
                "TOKENIZERS_PARALLELISM": "false",
                **({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"} if num_gpus else {}),  # a timed-out collective raises
                **(env or {}),
            }
        },
    }


@dataclass
class RankPlacement:
    """Where the ranks start and with what (their Ray options): CPUs and GPUs per rank, torch threads
    (0 = the machine's cores split among the ranks), a scheduling strategy per rank (placement-group
    bundles) or custom Ray resources each requires, and more environment (runtime.device.malloc_env)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    threads: int = 0
    scheduling: list | None = None
    resources: dict[str, float] | None = None
    env: dict[str, str] | None = None


def start_ranks(actor_cls, world_size: int, make_args, placement: RankPlacement | None = None) -> list:
    """One Ray actor per DeepSpeed rank, `actor_cls(*make_args(rank, addr, port, threads))`, all ready.
    The ranks rendezvous at addr:port on rank 0's node, which every rank needs before it is built:
    a probe task placed as rank 0 (same bundle or resources) finds that node, its IP and a free port
    there; rank 0 is then pinned to it (a placement-group bundle already is)."""
    p = placement or RankPlacement()
    scheduling = p.scheduling
    threads = p.threads or max(1, cpu_cores() // world_size)
    options = rank_options(p.num_cpus, p.num_gpus, threads, p.resources, p.env)
    place = [{"scheduling_strategy": s} for s in scheduling] if scheduling else [{}] * world_size
    probe = {k: v for k, v in options.items() if k != "runtime_env"} | place[0]
    for attempt in range(3):  # the port was free when probed; another process may take it before rank 0 binds it
        node, addr, port = ray.get(ray.remote(node_address).options(**probe).remote())
        if not scheduling:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            place[0] = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
        ranks = [
            ray.remote(actor_cls).options(**options, **place[rank]).remote(*make_args(rank, addr, port, threads))
            for rank in range(world_size)
        ]
        try:
            watchdog.get([r.ready.remote() for r in ranks])
            return ranks
        except ray.exceptions.RayActorError as e:
            for r in ranks:
                ray.kill(r)
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
            log.warning("learner: rendezvous port %d was taken before rank 0 bound it; trying another", port)
    raise AssertionError("unreachable")


class LearnerGroup:
    """The learner's ranks (one Learner actor each) behind one call per phase: it starts them (start_ranks)
    and owns their actor handles; each call goes to every rank and returns rank 0's answer (the ranks agree)."""

    def __init__(
        self,
        cfg: LearnerConfig,
        algo: AlgorithmConfig,
        sampling: SamplerSettings,
        world_size: int,
        seed: int,
        placement: RankPlacement | None = None,
        keep_freed_memory: bool = False,
        collective_timeout_s: float = 1800.0,
    ):
        """`sampling`: how the rollout engines sample (temperature, filters, samples per prompt);
        `placement`: where the ranks go (start_ranks; its threads default to cfg.threads, its env is
        set here); keep_freed_memory: see runtime.device.malloc_env; collective_timeout_s: how long
        a collective of the ranks may wait for one of them."""
        placement = placement or RankPlacement()
        placement = dataclasses.replace(
            placement,
            threads=placement.threads or cfg.threads,
            env=malloc_env(keep_freed_memory, placement.num_gpus > 0),
        )

        def args(rank, addr, port, threads):
            return cfg, algo, sampling, seed, RankAddress(rank, world_size, addr, port, threads, collective_timeout_s)

        # restart() builds the ranks again from the same arguments (a fresh rendezvous port each time)
        self._start = lambda: start_ranks(Learner, world_size, args, placement)
        self.ranks = self._start()

    def restart(self) -> None:
        """Kill every rank and start them all again, as new from the model (a rank that died takes the
        others' process group with it, so ZeRO's ranks restart together); the caller restores their state."""
        self.shutdown()
        self.ranks = self._start()

    def lost(self, error: BaseException) -> bool:
        """Whether `error` (ray.exceptions.RayActorError) reports one of this group's ranks dead or unreachable."""
        return died_among(error, self.ranks)

    def raise_if_lost(self, error: BaseException, timeout_s: float = 10.0) -> None:
        """Raise the RayActorError of a rank that is gone (`error`, a peer's failure, as its cause); a rank
        that answers, or does not answer in timeout_s, is not."""
        for rank in self.ranks:
            try:
                ray.get(rank.ready.remote(), timeout=timeout_s)
            except ray.exceptions.RayActorError as died:
                raise died from error
            except ray.exceptions.GetTimeoutError:
                continue

    def _all(self, method: str, *args):
        return self.wait_all([getattr(r, method).remote(*args) for r in self.ranks])

    def wait_all(self, calls: list) -> list:
        """ray.get of the ranks' `calls` (one per rank, in rank order). When a rank died, the others'
        collectives fail with it, and their error may come first: the dead rank's RayActorError is raised."""
        try:
            return watchdog.get(calls)
        except ray.exceptions.RayTaskError as e:
            for call in calls:
                try:
                    ray.get(call, timeout=10.0)
                except ray.exceptions.RayActorError as died:
                    raise died from e
                except Exception:  # noqa: BLE001 (a survivor's own failure: the dead rank's error is the cause)
                    continue
            raise

    def update(self, batch, scored, step: int) -> dict[str, float]:
        """Both phases of an update, as the trainer calls them: experience, then train."""
        self.experience(batch, scored)
        return self.train(step)

    def experience(self, batch, scored) -> None:
        """The advantage phase on every rank: old logprobs, values, KL and advantages, kept for train."""
        self._all("experience", batch, scored)

    def train(self, step: int) -> dict[str, float]:
        """The epochs of mini-batches on the kept experience; rank 0's metrics."""
        return self._all("train", step)[0]

    def update_kl(self, current_kl: float, n_samples: int) -> float:
        return self._all("update_kl", current_kl, n_samples)[0]

    def weight_buckets(self, bucket_mb: int):
        return watchdog.get(self.ranks[0].weight_buckets.remote(bucket_mb))

    def sync_address(self, backend: str, timeout_s: float) -> tuple[str, int]:
        """(IP, port) of the weight-sync store, on rank 0's node: rank 0 serves it (WeightSender.sync_address)."""
        return watchdog.get(self.ranks[0].sync_address.remote(backend, timeout_s))

    def init_weight_sync(self, address: GroupAddress, backend: str) -> list:
        """Rank 0 joins the rollout sync group at `address` as its rank 0, on the rollout side's
        `backend`; returns the pending calls."""
        return [r.init_weight_sync.remote(address, backend) for r in self.ranks]

    def send_weights(self, buckets, background: bool = False) -> list:
        plan = encode_plan(buckets)
        return [r.send_weights.remote(plan, background) for r in self.ranks]

    def adapter_weights(self):
        """A pending call: rank 0's LoRA adapter (WeightSender.adapter_weights). Handed to the engines as it is,
        the adapter goes from rank 0 to them through Ray's object store, never through the driver."""
        return self.ranks[0].adapter_weights.remote()

    def adapter_bytes(self) -> int:
        """The LoRA adapter's bytes as the engines take it (the same every sync)."""
        return watchdog.get(self.ranks[0].adapter_bytes.remote())

    def policy_state(self):
        return self._all("policy_state")[0]

    def policy_logprobs(self, batch, rows: int = 32, reference: bool = False) -> list[list[float]]:
        """The current policy's logprobs of `batch`'s response tokens, `rows` samples per forward; reference:
        its base's, the LoRA adapter off (learner.lora.reference learner)."""
        out = []
        for i in range(0, len(batch), rows):
            part = batch.select(list(range(i, min(i + rows, len(batch)))))
            out += self._all("policy_logprobs", part, reference)[0]
        return out

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """The policy's logprobs of the sync check's probe (every rank: a ZeRO-3 forward needs them all)."""
        return self._all("probe_logprobs", ids)[0]

    def describe(self) -> dict:
        return watchdog.get(self.ranks[0].describe.remote())

    def save(self, path: str | Path) -> Path:
        """Write into <path>.tmp on every rank, then rename: a crash mid-save leaves no valid-looking checkpoint."""
        final = Path(path)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self._all("save", str(tmp))
        publish(tmp, final)
        return final

    def load(self, path: str | Path) -> None:
        self._all("load", str(path))

    def shutdown(self) -> None:
        for r in self.ranks:
            ray.kill(r)
        self.ranks = []
