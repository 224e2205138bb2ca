"""Learner: one data-parallel rank (a Ray actor) holding the policy, the optional critic and their
DeepSpeed engines. The orchestrator calls every rank with the same arguments; ranks shard the work.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from learner import algorithms as A
from learner import losses as L
from learner.config import (
    AlgorithmConfig,
    KLControllerKind,
    KLPlacement,
    LearnerConfig,
    OffPolicyKind,
    PolicyLoss,
    ValueHead,
)
from learner.engine import (
    TOKENS,
    RankAddress,
    grad_norm,
    init_distributed,
    make_engine,
    mean_finite,
    skipped_steps,
    step_micro_batches,
    update_metrics,
)
from learner.experience import Experience, ForwardSettings, MicroBatch, experience_metrics, make_experience, single_pass
from learner.kl_control import AdaptiveKLController, FixedKLController
from learner.models import build_critic, build_policy, merged_lora, rollout_weights
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch
from rollout.weight_sync import (
    BACKENDS,
    GLOO_BACKEND,
    IPC_BACKEND,
    GroupAddress,
    NcclSender,
    SyncGroup,
    TensorMeta,
    broadcast_staged,
    decode_plan,
    free_port,
    ipc_update_info,
    plan_buckets,
    send_weights,
    stage_buckets,
    staged_tensors,
    wire_tensors,
)
from runtime.device import collective_backend, process_device, to_device
from runtime.logprobs import (
    SamplerSettings,
    chunked_logprobs,
    chunked_logprobs_entropy,
    filtered_logprobs,
    map_chunks,
)
from runtime.profiling import Profiled
from runtime.seeds import stream_seed

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed), np.random.seed(seed % 2**32), torch.manual_seed(seed)


def node_address() -> tuple[str, str, int]:
    """(Ray node id, node IP, a port free there) of the node this process runs on: a rendezvous
    served from here. The IP is the one Ray itself uses between nodes, so every node reaches it."""
    import ray

    ip = ray.util.get_node_ip_address()
    return ray.get_runtime_context().get_node_id(), ip, free_port(ip)


class Learner(Profiled):
    """One data-parallel learner rank (a Ray actor). Owns its device, its process group, the policy (with a
    value head when the critic is shared), the optional separate critic, their DeepSpeed engines and
    optimizers, the KL controller, and the weight-sync sender (rank 0). The update reads a scored
    rollout batch: experience (old logprobs, values, advantages), then epochs of mini-batches."""

    def __init__(
        self, cfg: LearnerConfig, algo: AlgorithmConfig, sampling: SamplerSettings, seed: int, address: RankAddress
    ):
        rank, world_size = address.rank, address.world_size
        if address.threads:
            torch.set_num_threads(address.threads)
        if cfg.logprob_chunk_tokens < 1:
            raise ValueError(f"learner.logprob_chunk_tokens must be at least 1, got {cfg.logprob_chunk_tokens}")
        self.device = process_device()  # from this actor's Ray resources: everything it computes lives there
        init_distributed(address, collective_backend(self.device))
        seed_everything(stream_seed(seed, "learner", rank))  # init and dropout: each rank its own stream
        self.cfg, self.algo, self.rank, self.world = cfg, algo, rank, world_size
        # the sampler's distribution: logprobs at its temperature, its filters for the gap metric
        self.seed, self.sampling = seed, sampling
        self.temperature, self.group_size = sampling.temperature, sampling.n_samples_per_prompt
        needs_critic = algo.needs_critic
        shared = needs_critic and cfg.value_head == ValueHead.shared
        self.policy = build_policy(cfg, value_head=shared)
        self.critic = build_critic(cfg) if needs_critic and not shared else None
        self.grad_accum = algo.mini_batch_size // (algo.micro_batch_size * world_size)
        self.policy_engine = make_engine(self.policy, cfg, cfg.lr, algo.micro_batch_size, self.grad_accum)
        self.critic_engine = (
            make_engine(self.critic, cfg, cfg.critic_lr, algo.micro_batch_size, self.grad_accum)
            if self.critic is not None
            else None
        )
        self.kl_ctl = (
            AdaptiveKLController(algo.init_kl_coef, algo.target_kl, algo.kl_horizon)
            if algo.kl_controller == KLControllerKind.adaptive
            else FixedKLController(algo.init_kl_coef)
        )
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.sync_group: SyncGroup | NcclSender | None = None  # rank 0: relay_gloo's group, or vLLM's NCCL
        self.sync_backend = GLOO_BACKEND
        self._ipc_kept: list[torch.Tensor] = []  # what the engines' IPC handles point into, until the next sync
        self._sending: _Sending | None = None  # a background weight broadcast (send_weights)
        self._staged: list[torch.Tensor] = []  # its copy of the weights, reused from sync to sync
        self.updates = 0
        self.pending: PendingUpdate | None = None  # the experience of the batch being trained (experience -> train)
        self.single_pass = True  # skip the recompute forward where experience.single_pass allows (tests turn it off)

    def ready(self) -> bool:
        return True

    @property
    def has_critic(self) -> bool:
        return self.critic is not None or self.policy.value_head is not None

    # ------------------------------------------------------------------ the update
    def update(self, batch: RolloutBatch, scored: ScoredBatch, step: int) -> dict[str, float]:
        """One PPO/GRPO update on a scored batch, both phases in one call: experience, then train."""
        self.experience(batch, scored)
        return self.train(step)

    def experience(self, batch: RolloutBatch, scored: ScoredBatch) -> None:
        """The paper's advantage phase: the learner's old logprobs and values, the KL to the reference
        and the advantages of a scored batch, kept on this rank for `train`."""
        start = time.perf_counter()
        skipped_before = self._skipped()
        one_pass = self.single_pass and single_pass(self.algo, len(batch))  # the update's forward: the old logprobs
        self.policy_engine.eval()
        run = ForwardSettings(
            self.sampling,
            self.pad_id,
            self.algo.micro_batch_size,
            self.rank,
            self.world,
            self.cfg.logprob_chunk_tokens,
            self.device,
        )
        exp = make_experience(
            self.policy_engine, self.critic_engine, batch, scored, self.algo, self.kl_ctl.value, run, not one_pass
        )
        self.pending = PendingUpdate(exp, len(batch), one_pass, start, skipped_before)

    def train(self, step: int) -> dict[str, float]:
        """Epochs of mini-batches on the experience `experience` kept; returns the update's metrics."""
        if self.pending is None:
            raise RuntimeError("Learner.train: call experience(batch, scored) first")
        p, self.pending = self.pending, None
        exp, n, one_pass, start, skipped_before = p.exp, p.rows, p.one_pass, p.start, p.skipped_before
        self.policy_engine.train()
        sums: dict[str, float] = defaultdict(float)
        n_mini, norms = 0, []
        for epoch in range(self.algo.ppo_epochs):
            shuffle = torch.Generator().manual_seed(stream_seed(self.seed, "mini_batches", step, epoch))
            order = torch.randperm(n, generator=shuffle)
            for rows in order.split(self.algo.mini_batch_size):
                if exp.mask[rows].any():  # else nothing trains (all invalid): no step, no move by Adam's momentum
                    self._train_mini_batch(exp, rows, sums, one_pass)
                    norms.append(grad_norm(self.policy_engine))
                    n_mini += 1
        if one_pass and self.world > 1:  # each rank filled its own rows: assemble them everywhere
            for t in (exp.old_logprobs, exp.sampler_logprobs):
                full = t.to(self.device)  # NCCL reduces device tensors only
                dist.all_reduce(full)
                t.copy_(full.cpu())
        metrics = self._reduce(sums, n_mini)
        metrics["learner/grad_norm"] = mean_finite(norms)  # pre-clip, over the update's optimizer steps
        metrics.update(experience_metrics(exp, self.algo, self.kl_ctl.value))
        metrics["learner/skipped_steps"] = skipped = float(self._skipped() - skipped_before)
        if skipped:
            log.warning("learner: skipped %d optimizer step(s) with non-finite gradients", skipped)
        tokens = float(exp.mask.sum()) * self.algo.ppo_epochs
        metrics["learner/tokens_per_s"] = tokens / (time.perf_counter() - start)
        self.updates += 1
        return metrics

    def _train_mini_batch(self, exp: Experience, rows: torch.Tensor, sums: dict[str, float], one_pass: bool) -> None:
        """One optimizer step on exactly `rows`, whatever their count (engine.step_micro_batches)."""
        agg, micro = self.algo.loss_aggregation.value, self.algo.micro_batch_size
        total = max(A.aggregate_total(exp.mask[rows], agg), 1e-8)
        mine = exp.by_length(rows)[self.rank :: self.world]  # similar lengths per micro-batch (and per rank)
        scale = self.grad_accum * self.world  # undo DeepSpeed's mean over micro-batches and ranks
        for idx, padding in step_micro_batches(rows, mine, self.world, micro, (self.policy_engine, self.critic_engine)):
            weight = 0.0 if padding else scale
            mb = exp.rows(idx).to(self.device)
            policy_loss, values, m = self._policy_loss(mb, total, agg, exp if one_pass and not padding else None, idx)
            if self.critic_engine is not None:
                values = self.critic_engine(mb.input_ids, mb.attention_mask, mb.position_ids)
            if values is not None:
                vf_loss, vm = A.ppo_value_loss(
                    values,
                    mb.old_values,
                    mb.returns,
                    mb.mask,
                    self.algo.gae.value_clip_eps,
                    agg,
                    total,
                    loss_norm_tokens(self.algo, self.sampling),
                )
                m["loss/value"] = vf_loss.item()
                m["learner/vf_clip_frac"] = vm["vf_clip_frac"].item() * m[TOKENS]
                if self.critic_engine is None:
                    policy_loss = policy_loss + self.algo.gae.vf_coef * vf_loss
                else:
                    self.critic_engine.backward(self.algo.gae.vf_coef * vf_loss * weight)
                    self.critic_engine.step()
            if not torch.isfinite(policy_loss):
                m["learner/nonfinite_losses"] = 1.0  # its gradients are non-finite: the step is skipped
            self.policy_engine.backward(policy_loss * weight)
            self.policy_engine.step()
            for k, v in ({} if padding else m).items():
                sums[k] += v

    def _policy_loss(self, mb: MicroBatch, total: float, agg: str, fill: Experience | None = None, idx=None):
        """fill (single pass): the old logprobs are this forward's, detached; they are written into
        fill's rows `idx` (and the sampler-filtered ones for the gap metric) for the metrics."""
        logits, values = self.policy_engine(mb.input_ids, mb.attention_mask, mb.position_ids)
        how = LossSettings(
            self.temperature,
            self.cfg.logprob_chunk_tokens,
            total,
            agg,
            loss_norm_tokens(self.algo, self.sampling),
            self.sampling.top_k,
            self.sampling.top_p,
            old_from_forward=fill is not None,
        )
        loss, terms = policy_loss(logits, mb, self.algo, self.kl_ctl.value, how)
        if fill is not None:
            self._fill_old(fill, idx, mb, terms["logprobs"], terms["sampler_logprobs"])
        return loss, values, micro_metrics(terms, mb.mask)

    def _fill_old(
        self, exp: Experience, idx: torch.Tensor, mb: MicroBatch, logprobs: torch.Tensor, sampled: torch.Tensor
    ) -> None:
        mask, w = mb.mask, mb.mask.shape[1]  # the micro-batch is trimmed to its own width (Experience.rows)
        exp.old_logprobs[idx, :w] = (logprobs * mask).cpu()
        exp.sampler_logprobs[idx, :w] = torch.where(mask > 0, sampled, 0.0).cpu()

    def _reduce(self, sums: dict[str, float], n_mini: int) -> dict[str, float]:
        """Sum each metric over ranks, then engine.update_metrics (per token over the whole update)."""
        sums.setdefault("learner/nonfinite_losses", 0.0)
        keys = sorted(sums)
        vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(vec)
        return update_metrics(dict(zip(keys, vec.tolist())), n_mini)

    def _skipped(self) -> int:
        return skipped_steps(self.policy_engine) + (skipped_steps(self.critic_engine) if self.critic_engine else 0)

    # ------------------------------------------------------------------ KL controller
    def update_kl(self, current_kl: float, n_samples: int) -> float:
        self.kl_ctl.update(current_kl, n_samples)
        return self.kl_ctl.value

    # ------------------------------------------------------------------ weights to the rollout engines
    def weight_buckets(self, bucket_mb: int) -> list[list[TensorMeta]]:
        # sent in the engines' dtype (rollout.dtype = learner.dtype): bf16 runs cast the float32 master
        # weights on the way, as autocast casts them for the learner's own matmuls
        metas = [
            TensorMeta(
                n,
                tuple(getattr(p, "ds_shape", p.shape)),
                self.cfg.dtype.value if p.is_floating_point() else str(p.dtype).removeprefix("torch."),
            )
            for n, p in rollout_weights(self.policy)
        ]
        return plan_buckets(metas, bucket_mb << 20)

    def sync_address(self) -> tuple[str, int]:
        """Where the weight-sync store will listen: rank 0 serves it (SyncGroup rank 0 is its master),
        so its node's IP and a port free on that node."""
        return node_address()[1:]

    def init_weight_sync(self, address: GroupAddress, backend: str) -> None:
        """Rank 0 joins the rollout side's group at `address` as its sender (rank 0), on the rollout
        side's `backend` (rollout.weight_sync.BACKENDS)."""
        self._sending = None  # a background sync of the old group died with it (an engine restarted)
        self.sync_backend, self._ipc_kept = backend, []
        if self.rank == 0:
            if BACKENDS.get(backend) != self.device.type:
                raise ValueError(
                    f"weight sync: the rollout engines use {backend}, but learner rank 0 is on "
                    f"{self.device}; give the learner GPUs too (cluster.gpus_per_learner) or neither"
                )
            if backend == GLOO_BACKEND:
                a = address
                self.sync_group = SyncGroup(a.host, a.port, 0, a.world_size, "gloo", a.timeout_s)
            elif backend != IPC_BACKEND:  # vLLM's NCCL engine: its trainer side
                self.sync_group = NcclSender(address.host, address.port, address.world_size, address.bucket_bytes)

    def send_weights(self, plan: bytes, background: bool = False) -> int | dict:
        """Every rank calls this (ZeRO-3 gathers need all of them); rank 0 sends the buckets of
        `plan` (weight_sync.encode_plan). background (asynchronous training, ZeRO 0-2): rank 0
        returns once it has staged a copy, and a thread broadcasts it while the next update runs;
        the next call (or a reconnect) waits for it first. Returns the bytes sent; on IPC, each
        rank's update_info with handles to its own GPU's copy (the channel merges them)."""
        self._await_sent()
        buckets = decode_plan(plan)
        params = dict(rollout_weights(self.policy))
        with merged_lora(self.policy):
            if self.sync_backend == IPC_BACKEND:
                info, self._ipc_kept = ipc_update_info(self._gathered(buckets, params))
                return info
            if background and self.cfg.zero_stage != 3:
                return self._send_in_background(buckets, params)
            if self.sync_backend != GLOO_BACKEND:
                return self._send_nccl(buckets, params)
            if self.cfg.zero_stage == 3:
                import deepspeed

                sent = 0
                for bucket in buckets:
                    with deepspeed.zero.GatheredParameters([params[m.name] for m in bucket]):
                        if self.rank == 0:
                            sent += send_weights(self.sync_group, [bucket], params.__getitem__)
                return sent
            return send_weights(self.sync_group, buckets, params.__getitem__) if self.rank == 0 else 0

    def _send_in_background(self, buckets: list[list[TensorMeta]], params: dict) -> int:
        """Rank 0 stages a copy and a thread sends it (relay_gloo: bucket by bucket; nccl: packed)."""
        if self.rank != 0:
            return 0
        self._staged = stage_buckets(buckets, params.__getitem__, self._staged)
        group, staged = self.sync_group, self._staged
        if self.sync_backend == GLOO_BACKEND:
            self._sending = _Sending(lambda: broadcast_staged(group, staged))
        else:
            self._sending = _Sending(lambda: group.send(staged_tensors(buckets, staged)))
        return sum(t.numel() * t.element_size() for t in self._staged)

    def _send_nccl(self, buckets: list[list[TensorMeta]], params: dict) -> int:
        """vLLM's NCCL engine takes one packed stream of every tensor; every rank walks it (ZeRO-3's
        gathers), rank 0 sends."""
        tensors = self._gathered(buckets, params)
        if self.rank == 0:
            return self.sync_group.send(tensors)
        for _ in tensors:
            pass
        return 0

    def _gathered(self, buckets: list[list[TensorMeta]], params: dict):
        """wire_tensors of `buckets`; under ZeRO-3 each bucket gathered in turn and copied out (the
        gathered parameters are freed when the next bucket is gathered)."""
        if self.cfg.zero_stage != 3:
            yield from wire_tensors(buckets, params.__getitem__)
            return
        import deepspeed

        for bucket in buckets:
            with deepspeed.zero.GatheredParameters([params[m.name] for m in bucket]):
                yield from ((n, t.clone()) for n, t in wire_tensors([bucket], params.__getitem__))

    def _await_sent(self) -> None:
        sending, self._sending = self._sending, None
        if sending is not None:
            sending.wait()

    def policy_state(self) -> dict[str, torch.Tensor]:
        """Full policy weights by Hugging Face name, on CPU (for the in-process sync path and tests)."""
        params = dict(rollout_weights(self.policy))
        with merged_lora(self.policy):
            if self.cfg.zero_stage == 3:
                import deepspeed

                with deepspeed.zero.GatheredParameters(list(params.values())):
                    return {n: p.detach().cpu().clone() for n, p in params.items()}
            return {n: p.detach().cpu().clone() for n, p in params.items()}

    def describe(self) -> dict:
        """What this rank built: for logs and tests."""
        return {
            "value_head": self.policy.value_head is not None,
            "critic": self.critic is not None,
            "trainable": [n for n, p in self.policy.named_parameters() if p.requires_grad],
            "zero_stage": self.cfg.zero_stage,
            "world_size": self.world,
        }

    @torch.no_grad()
    def policy_logprobs(self, batch: RolloutBatch) -> list[list[float]]:
        """The current policy's logprob of every response token (at the sampling temperature)."""
        from rollout.types import pack, unpad

        self.policy_engine.eval()
        inputs = pack(batch.prompt_ids, batch.response_ids, self.pad_id)
        ids, attention, positions = to_device(inputs[:3], self.device)
        logits, _ = self.policy_engine(ids, attention, positions)
        logprobs = chunked_logprobs(logits, ids[:, 1:], self.temperature, self.cfg.logprob_chunk_tokens)
        self.policy_engine.train()
        return unpad(logprobs.cpu(), inputs[3])

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str) -> None:
        from learner.checkpoint import save_learner

        save_learner(self, path)

    def load(self, path: str) -> None:
        from learner.checkpoint import load_learner

        load_learner(self, path)


@dataclass
class PendingUpdate:
    """What `Learner.experience` keeps for `Learner.train`: the batch's experience and its row count,
    whether the update's own forward gives the old logprobs, and the update's start (its token rate)."""

    exp: Experience
    rows: int
    one_pass: bool
    start: float  # time.perf_counter() when the experience began
    skipped_before: int  # optimizer steps skipped before this update


class _Sending:
    """A weight broadcast on a thread of its own; wait() joins it and raises what it raised."""

    def __init__(self, send: Callable[[], object]):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(send,), daemon=True, name="relay-weight-sync")
        self.thread.start()

    def _run(self, send: Callable[[], object]) -> None:
        try:
            send()
        except BaseException as e:  # noqa: BLE001 - re-raised by wait(), in the caller's thread
            self.error = e

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"the background weight sync failed: {self.error}") from self.error


@dataclass
class LossSettings:
    """How policy_loss reads a micro-batch, beside the algorithm config: the sampler's distribution
    (temperature, top-k/top-p filter), the logprob chunking, and the aggregation over the mini-batch."""

    temperature: float  # the sampler's: logprobs are of logits / temperature
    chunk_tokens: int  # tokens whose logits are upcast to float32 at once
    total: float  # aggregate's denominator for the whole mini-batch
    aggregation: str  # algorithm.loss_aggregation
    norm_tokens: float | None = None  # seq_sum_norm's constant (loss_norm_tokens)
    top_k: int = -1  # the sampler's filter, under which pi_prox meets mu (terms["sampler_logprobs"])
    top_p: float = 1.0
    old_from_forward: bool = False  # experience.single_pass: the old logprobs are this forward's, detached


def policy_loss(
    logits: torch.Tensor, mb: MicroBatch, algo: AlgorithmConfig, kl_coef: float, how: LossSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's loss from its logits (B, L-1, V) (the policy loss is algorithm.policy_loss's, from
    learner/losses.py's table), and its terms (policy, entropy, clip_frac, approx_kl, kl when placed in
    the loss, and the detached logprobs). Logprobs and entropy come chunk by chunk (no float32
    (B, L-1, V) tensor); the entropy enters the graph only when entropy_coef uses it.
    how.old_from_forward (experience.single_pass): the old logprobs are these logprobs, detached, instead
    of mb.old_logprobs. *_token terms: per-token means (metrics), whatever the aggregation."""
    mask, use_entropy = mb.mask, algo.entropy_coef != 0
    agg, total, norm_tokens = how.aggregation, how.total, how.norm_tokens
    logprobs, entropy = chunked_logprobs_entropy(
        logits, mb.input_ids[:, 1:], how.temperature, how.chunk_tokens, entropy_grad=use_entropy
    )
    old = logprobs.detach() if how.old_from_forward else mb.old_logprobs  # the proximal policy's
    sampled, weights = off_policy_terms(logits, mb, algo, how, old)
    # cispo's lower bound has its own key: the paper has none, and PPO's clip_eps would impose one
    low = (algo.cispo.clip_low or None) if algo.policy_loss == PolicyLoss.cispo else algo.clip_eps
    pg, pm = L.POLICY_LOSSES[algo.policy_loss.value](
        A.PolicyLossInput(logprobs, old, mb.advantages, mask, agg, total, weights, norm_tokens),
        low,
        algo.clip_eps_high or algo.clip_eps,
    )
    ent_token, entropy = entropy, A.aggregate(entropy, mask, agg, total, norm_tokens)
    loss = pg - algo.entropy_coef * entropy if use_entropy else pg
    terms = {
        "policy": pg,
        "entropy": entropy,
        "entropy_token": A.masked_mean(ent_token.detach(), mask),
        "clip_frac": pm["clip_frac"],
        "approx_kl": pm["approx_kl"],
        "logprobs": logprobs.detach(),
        "sampler_logprobs": sampled,
    }
    if algo.kl_placement == KLPlacement.loss:
        kl = A.kl_penalty(logprobs, mb.ref_logprobs, algo.kl_estimator.value, mask)
        terms["kl"] = A.aggregate(kl, mask, agg, total, norm_tokens)
        terms["kl_token"] = A.masked_mean(kl.detach(), mask)
        loss = loss + kl_coef * terms["kl"]
    return loss, terms


def off_policy_terms(
    logits: torch.Tensor, mb: MicroBatch, algo: AlgorithmConfig, how: LossSettings, old: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(pi_prox's logprobs under the sampler's filter, or None where nothing reads them; the off-policy
    correction's weights, or None without one). pi_prox as the sampler saw it: mu (the engine's processed
    logprobs) is renormalised inside the filter, so an unfiltered pi_prox would put the ratio below 1 in
    sync mode."""
    o, mask = algo.off_policy, mb.mask
    sampled = mb.sampler_logprobs if not how.old_from_forward and o.correction != OffPolicyKind.none else None
    if how.old_from_forward:
        sampled = (
            map_chunks(
                lambda x, y: filtered_logprobs(x, y, how.top_k, how.top_p),
                logits.detach(),
                mb.input_ids[:, 1:],
                how.temperature,
                how.chunk_tokens,
            )
            if how.top_k > 0 or how.top_p < 1.0
            else old
        )
    weights = (
        A.off_policy_weights(
            sampled, mb.behaviour_logprobs, mask, o.correction.value, o.level.value, o.cap, o.low, o.high
        )
        if o.correction != OffPolicyKind.none
        else None
    )
    return sampled, weights


def micro_metrics(terms: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
    """A micro-batch's metrics for engine.update_metrics: its loss, and its per-token means times its
    response tokens (summed, then divided by the update's tokens: one unit in every aggregation)."""
    tokens = float(mask.sum())
    m = {"loss/policy": terms["policy"].item(), TOKENS: tokens}
    names = {
        "learner/entropy": "entropy_token",
        "learner/clip_frac": "clip_frac",
        "learner/approx_kl": "approx_kl",
        "loss/kl": "kl_token",
    }
    m.update({k: terms[t].item() * tokens for k, t in names.items() if t in terms})
    return m


def loss_norm_tokens(algo: AlgorithmConfig, sampling: SamplerSettings) -> int:
    """seq_sum_norm's constant (Dr. GRPO): algorithm.loss_norm_tokens (the trainer sets 0 to the sample's
    whole budget, orchestrator.loop.roles.learner_algorithm), else one response's max_new_tokens."""
    return algo.loss_norm_tokens or sampling.max_new_tokens
