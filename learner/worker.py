"""Learner: one data-parallel rank (a Ray actor) holding the policy, the optional critic and their
DeepSpeed engines. The orchestrator calls every rank with the same arguments; ranks shard the work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from learner import algorithms as A
from learner.config import AlgorithmConfig, KLControllerKind, LearnerConfig, ValueHead
from learner.engine import (
    COMPUTED,
    REAL,
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
from learner.experience import (
    Experience,
    ForwardSettings,
    MicroBatch,
    experience_metrics,
    make_experience,
    reference_logprobs,
    single_pass,
)
from learner.kl_control import AdaptiveKLController, FixedKLController
from learner.micro_batch_loss import LossSettings, loss_norm_tokens, micro_metrics, policy_loss
from learner.models import build_critic, build_policy, merged_weights
from learner.precision import zero_stage
from learner.weight_sender import WeightSender
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch
from runtime.device import collective_backend, process_device, to_device
from runtime.logprobs import SamplerSettings, chunked_logprobs
from runtime.ports import free_port
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


class Learner(WeightSender, Profiled):
    """One data-parallel learner rank (a Ray actor). Owns its device, its process group, the policy (with a
    value head when the critic is shared), the optional separate critic, their DeepSpeed engines and
    optimizers, the KL controller, and the weight-sync sender (rank 0; WeightSender). The update reads a scored
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
        self._init_sender()
        self.updates = 0
        self.pending: PendingUpdate | None = None  # the experience of the batch being trained (experience -> train)
        self.single_pass = True  # skip the recompute forward where experience.single_pass allows (tests turn it off)
        # learner.lora.reference: the reference is this policy's base, its adapter off, computed here (no second copy)
        self.reference_here = cfg.lora.reference_in_learner

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
        reference_s = 0.0  # the reference's forward here, inside this phase (a LoRA policy's base), else none
        if self.reference_here:
            began = time.perf_counter()
            ref = reference_logprobs(self.policy_engine, self.policy.lm, batch, run)
            scored, reference_s = dataclasses.replace(scored, ref_logprobs=ref), time.perf_counter() - began
        exp = make_experience(
            self.policy_engine, self.critic_engine, batch, scored, self.algo, self.kl_ctl.value, run, not one_pass
        )
        self.pending = PendingUpdate(exp, len(batch), one_pass, start, skipped_before, reference_s)

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
        # the reference's forward is left out: the same work as a run whose scoring service computes it
        metrics["learner/tokens_per_s"] = tokens / (time.perf_counter() - start - p.reference_s)
        if self.reference_here:  # seconds of timing/advantages: the reference is a phase of its own elsewhere
            metrics["learner/reference_s"] = p.reference_s
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
            m[REAL], m[COMPUTED] = self.policy.tokens  # as the forward computed them (flash: one row; OPT: padded)
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
    def policy_state(self) -> dict[str, torch.Tensor]:
        """Full policy weights by Hugging Face name, on CPU (for the in-process sync path and tests)."""
        params = merged_weights(self.policy)
        if self.cfg.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(params.values())):
                return {n: params[n].detach().cpu().clone() for n in params}
        return {n: params[n].detach().cpu().clone() for n in params}

    def describe(self) -> dict:
        """What this rank built: for logs and tests."""
        return {
            "value_head": self.policy.value_head is not None,
            "critic": self.critic is not None,
            "trainable": [n for n, p in self.policy.named_parameters() if p.requires_grad],
            "zero_stage": zero_stage(self.cfg),  # at least 2 under master weights
            "weights": str(next(self.policy.parameters()).dtype).removeprefix("torch."),
            "world_size": self.world,
        }

    @torch.no_grad()
    def policy_logprobs(self, batch: RolloutBatch, reference: bool = False) -> list[list[float]]:
        """The current policy's logprob of every response token (at the sampling temperature); reference: the
        LoRA policy's base instead (its adapter disabled), where this learner computes the reference."""
        from rollout.types import pack, unpad

        self.policy_engine.eval()
        inputs = pack(batch.prompt_ids, batch.response_ids, self.pad_id)
        ids, attention, positions = to_device(inputs[:3], self.device)
        with self.policy.lm.disable_adapter() if reference else contextlib.nullcontext():
            logits, _ = self.policy_engine(ids, attention, positions)
        logprobs = chunked_logprobs(logits, ids[:, 1:], self.temperature, self.cfg.logprob_chunk_tokens)
        self.policy_engine.train()
        return unpad(logprobs.cpu(), inputs[3])

    @torch.no_grad()
    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """The policy's logprob of each token of `ids` after the first, at temperature 1: the learner's side of
        the sync check (rollout/sync_check.py), computed before its weights leave it."""
        x = torch.tensor([ids], device=self.device)
        positions = torch.arange(len(ids), device=self.device).unsqueeze(0)
        self.policy_engine.eval()
        logits, _ = self.policy_engine(x, torch.ones_like(x), positions)
        self.policy_engine.train()
        return chunked_logprobs(logits, x[:, 1:], 1.0, self.cfg.logprob_chunk_tokens)[0].float().cpu().tolist()

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
    reference_s: float  # the reference's forward in the experience (LoRA's base), 0 where the scoring service ran it
