"""DeepSpeed engines for the learner: ZeRO 0-3, CPU (gloo) or GPU (NCCL), client or DeepSpeed Adam."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from learner.config import LearnerConfig, OptimizerKind
from learner.precision import bucket_elements, master_weights, zero_stage
from runtime.device import bf16_parameters, process_device


class FiniteSteps:
    """Mixin of a torch optimizer: skips a step whose gradients are not finite (and counts it), so one
    bad batch cannot poison the weights or the moments. Without ZeRO it also clips (max_norm > 0) and
    records the pre-clip norm, which DeepSpeed reports; under ZeRO 1-3 DeepSpeed clips and checks first.
    `overflow` says the last step was skipped, as DeepSpeed's own optimizers say it: without ZeRO the
    engine then counts it (engine.skipped_steps) and leaves the lr schedule where it is, as under ZeRO."""

    def __init__(self, params, max_norm: float = 0.0, **kwargs):
        super().__init__(params, **kwargs)
        self.max_norm, self.skipped, self._global_grad_norm, self.overflow = max_norm, 0, None, False

    @torch.no_grad()
    def step(self, closure=None):
        self.overflow = False
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return super().step(closure)
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm if self.max_norm > 0 else float("inf"))
        self._global_grad_norm = float(norm)
        if not torch.isfinite(norm):
            self.skipped, self.overflow = self.skipped + 1, True
            return None
        return super().step(closure)


class GuardedAdamW(FiniteSteps, torch.optim.AdamW):
    """torch's AdamW that skips (and counts) a non-finite step (FiniteSteps)."""


@functools.cache
def guarded_deepspeed_adam() -> type:
    """DeepSpeed's own Adam (FusedAdam: what DeepSpeed builds for optimizer AdamW without ZeRO) that skips
    (and counts) a non-finite step. Without ZeRO DeepSpeed never checks fp32 gradients itself: it would
    apply the NaN step and report nothing skipped."""
    from deepspeed.ops.adam import FusedAdam

    class GuardedDeepSpeedAdam(FiniteSteps, FusedAdam):
        pass

    return GuardedDeepSpeedAdam


@dataclass(frozen=True)
class RankAddress:
    """Where one learner rank sits: its rank among world_size, the group's rendezvous at
    master_addr:master_port (init_distributed), its torch threads (0 = torch's default), and how long
    one of the group's collectives may wait for the other ranks before it fails."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    threads: int = 0
    collective_timeout_s: float = 1800.0


SHM_COMM_OP = "deepspeed_shm_comm"  # ShareMemCommBuilder.NAME: its key in deepspeed.ops.__compatible_ops__


def init_distributed(address: RankAddress, backend: str) -> None:
    """The learner ranks' own process group (the default group of these processes). `backend`
    follows the rank's device (runtime.device.collective_backend). Ray makes exactly the actor's
    own GPU visible, so it is always local device 0. A collective waiting on a rank that is gone
    fails after address.collective_timeout_s (NCCL: its async error handling, set in rank_options)."""
    import datetime

    import deepspeed

    os.environ.update(
        RANK=str(address.rank),
        WORLD_SIZE=str(address.world_size),
        LOCAL_RANK="0",
        MASTER_ADDR=address.master_addr,
        MASTER_PORT=str(address.master_port),
    )
    timeout = datetime.timedelta(seconds=address.collective_timeout_s)
    if backend == "gloo":
        # DeepSpeed's shared-memory all-reduce (a CPU op: no GPU accelerator builds it) serves only its inference
        # engine (inference_all_reduce), which relay never calls. Left on, the first rank of every environment
        # JIT-compiles it (two C++ files: 50 s of CPU on a Xeon with AMX, again for each venv path), and every rank
        # maps its shared-memory buffers. Off, DeepSpeed's collectives are the process group's, as off Linux.
        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)


def warmup_schedule(warmup_steps: int):
    return lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def deepspeed_config(cfg: LearnerConfig, stage: int, micro_batch: int, grad_accum: int, trained: int) -> dict:
    """The engine's DeepSpeed config. Master weights: bf16 weights, float32 masters, and gradients summed in
    float32 over micro-batches (grad_accum_dtype) and over ranks (communication_data_type: DeepSpeed would
    reduce them in the bf16 model dtype, 1.8e-4 off on two ranks of a toy model). ZeRO's buckets no larger than
    the `trained` parameters (a 1 GB bf16 bucket for a 4k-parameter head otherwise): bucket_elements."""
    bucket = bucket_elements(trained)
    ds = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        # without ZeRO the guarded optimizer clips (it sees whole gradients); with ZeRO, DeepSpeed does
        "gradient_clipping": cfg.grad_clip if stage > 0 else 0.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "zero_allow_untested_optimizer": True,  # GuardedAdamW is torch's AdamW plus a finiteness check
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
    }
    if master_weights(cfg):
        ds |= {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}
    return ds


def make_engine(module: torch.nn.Module, cfg: LearnerConfig, lr: float, micro_batch: int, grad_accum: int):
    import deepspeed

    stage = zero_stage(cfg)
    if master_weights(cfg):
        bf16_parameters(module)  # the heads relay builds in float32 (the value head) too
    # otherwise learner.dtype bfloat16 is autocast over float32 weights (learner.models.compute)
    params = [p for p in module.parameters() if p.requires_grad]  # what DeepSpeed buckets (LoRA: the adapters)
    ds = deepspeed_config(cfg, stage, micro_batch, grad_accum, sum(p.numel() for p in params))
    schedule = warmup_schedule(cfg.warmup_steps)
    adam = dict(lr=lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    max_norm = cfg.grad_clip if stage == 0 else 0.0
    if cfg.optimizer == OptimizerKind.torch_adamw:
        # torch's fused AdamW kernel, one launch for every tensor; decided by the rank's device, as the model is
        # still on the CPU here (DeepSpeed moves it in initialize)
        fused = process_device().type == "cuda"
        optimizer = GuardedAdamW(params, max_norm=max_norm, fused=fused or None, **adam)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    elif stage == 0:  # built here, guarded: DeepSpeed checks gradients for non-finite values only under ZeRO
        optimizer = guarded_deepspeed_adam()(params, max_norm=max_norm, adam_w_mode=True, **adam)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    else:
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": lr, "betas": list(cfg.betas), "weight_decay": cfg.weight_decay},
        }
        optimizer = None
        scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule)  # noqa: E731
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=module, model_parameters=params, optimizer=optimizer, lr_scheduler=scheduler, config=ds
    )
    if stage == 0 and torch.distributed.get_world_size() == 1:
        # one rank has nothing to all-reduce, but DeepSpeed would still flatten every gradient into a
        # bucket and copy it back each step (0.6 s of a SmolLM2 update on a CPU)
        engine.enable_backward_allreduce = False
    return engine


def step_micro_batches(rows: torch.Tensor, mine: torch.Tensor, world: int, micro: int, engines: tuple):
    """One optimizer step's micro-batches for the rank whose share of `rows` is `mine`: (indices,
    padding), as many as rank 0 has (it has the most rows) so the ranks' collectives pair up; a rank
    with no rows left makes a padding pass (one row, to be weighted 0). The step's boundary is set
    on `engines` (None skipped) before each: DeepSpeed's own count assumes gradient_accumulation_steps
    micro-batches per step, so a short mini-batch would miss its step and leak into the next."""
    n = max(-(-(-(-len(rows) // world)) // micro), 1)
    for j in range(n):
        for engine in [e for e in engines if e is not None]:
            engine.set_gradient_accumulation_boundary(j == n - 1)
        idx = mine[j * micro : (j + 1) * micro]
        yield (rows[:1], True) if len(idx) == 0 else (idx, False)


def grad_norm(engine) -> float:
    """The last optimizer step's pre-clip gradient norm; NaN where the engine gives none (an optimizer
    that records no norm): unknown, never 0."""
    norm = engine.get_global_grad_norm()
    return float("nan") if norm is None else float(norm)


TOKENS = "learner/metric_tokens"  # the response tokens each micro-batch's per-token metrics were weighted by
REAL, COMPUTED = "learner/real_tokens", "learner/computed_tokens"  # each forward's, for packing_efficiency
PER_TOKEN = ("learner/entropy", "learner/clip_frac", "learner/approx_kl", "loss/kl", "learner/vf_clip_frac")


def update_metrics(sums: dict[str, float], n_mini: int) -> dict[str, float]:
    """The update's metrics from their sums over micro-batches and ranks (micro_batch_loss.micro_metrics): the
    per-token ones divided by every response token of the update (a 1-row mini-batch weighs its
    tokens, not half), the non-finite loss count as a count, a loss (one per mini-batch) averaged."""
    tokens = sums.get(TOKENS, 0.0)
    out = {}
    if sums.get(COMPUTED):  # real / computed tokens of the update's decoder forwards (PolicyValue.tokens;
        # the LM head runs on the padded layout either way)
        out["learner/packing_efficiency"] = sums[REAL] / sums[COMPUTED]
    for k, v in sums.items():
        if k in (REAL, COMPUTED):
            continue
        if k in PER_TOKEN:
            out[k] = v / tokens if tokens else float("nan")
        elif k != TOKENS:
            out[k] = v if k == "learner/nonfinite_losses" else v / max(n_mini, 1)
    return out


def mean_finite(values: list[float]) -> float:
    """The mean of the finite values (nan if none): e.g. grad norms, a skipped step's being inf."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def skipped_steps(engine) -> int:
    """Optimizer steps skipped for non-finite gradients, by DeepSpeed or by a FiniteSteps optimizer (one
    DeepSpeed drives directly, without ZeRO, it counts already: it reads the optimizer's `overflow`)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    own = 0 if inner is engine.optimizer else int(getattr(inner, "skipped", 0))
    return int(engine.skipped_steps) + own
