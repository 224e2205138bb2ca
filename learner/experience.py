"""From a scored rollout batch to training tensors: old logprobs and values recomputed by the
learner, the KL to the reference, and advantages, all through learner/algorithms.py.

Every tensor is (B, L-1), aligned with the logits of the packed prompt+response sequences;
`mask` marks the response tokens of the samples that train.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from learner import algorithms as A
from learner import losses as L
from learner.config import AlgorithmConfig, Estimator, KLPlacement
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch, pack
from runtime.device import to_device
from runtime.logprobs import DEFAULT_CHUNK_TOKENS, SamplerSettings, chunked_logprobs, filtered_logprobs, map_chunks


@dataclass
class Experience:
    """One rank's training tensors of a batch, aligned with the logits of the packed sequences."""

    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    position_ids: torch.Tensor  # (B, L)
    mask: torch.Tensor  # (B, L-1) response tokens of samples that train
    old_logprobs: torch.Tensor  # (B, L-1) the learner's own, before this update
    ref_logprobs: torch.Tensor  # (B, L-1)
    behaviour_logprobs: torch.Tensor  # (B, L-1) the sampler's (for the gap metric)
    sampler_logprobs: torch.Tensor  # (B, L-1) the learner's under the sampler's top-k/top-p filter (-inf outside)
    old_values: torch.Tensor | None  # (B, L-1) critic estimates, or None without a critic
    advantages: torch.Tensor  # (B, L-1)
    returns: torch.Tensor | None  # (B, L-1) value targets, or None without a critic

    def rows(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows `idx`, without the padding columns all of them share (right padding: exact, and a
        micro-batch of short rows no longer pays for the batch's longest)."""
        width = int(self.attention_mask[idx].sum(-1).max())
        return {
            k: (v[idx, : width if k in FULL_WIDTH else width - 1] if isinstance(v, torch.Tensor) else v)
            for k, v in vars(self).items()
        }

    def by_length(self, idx: torch.Tensor) -> torch.Tensor:
        """`idx` longest first: consecutive micro-batches then hold rows of similar length (bucketing)."""
        return idx[torch.argsort(self.attention_mask[idx].sum(-1), descending=True, stable=True)]


FULL_WIDTH = ("input_ids", "attention_mask", "position_ids")  # (B, L); every other tensor is (B, L-1)


def ragged_to_dense(rows: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    """Scatter per-response-token values into the (B, L-1) positions `mask` marks (row-major, one copy)."""
    out = torch.zeros_like(mask)
    counts = (mask > 0).sum(-1).tolist()
    if [len(r) for r in rows] != counts:
        raise ValueError(
            f"ragged_to_dense: row lengths {[len(r) for r in rows][:8]}... differ from the mask's {counts[:8]}..."
        )
    out[mask > 0] = torch.tensor([v for row in rows for v in row], dtype=out.dtype)
    return out


def sharded_forward(
    fn, n: int, micro: int, rank: int, world: int, device: torch.device = torch.device("cpu")
) -> list[torch.Tensor | None]:
    """Run fn(rows) -> tensors (on `device`) over this rank's rows in micro-batches (no grad), then
    assemble the full (n, ...) results on every rank with one all-reduce each (on `device`: NCCL
    reduces GPU tensors only), and return them on the CPU beside the rest of the experience."""
    mine = torch.arange(rank, n, world)
    parts = [fn(mine[i : i + micro]) for i in range(0, len(mine), micro)]
    outs = []
    for k in range(len(parts[0]) if parts else 0):
        if parts[0][k] is None:
            outs.append(None)
            continue
        full = torch.zeros((n, *parts[0][k].shape[1:]), dtype=torch.float32, device=device)
        full[mine.to(device)] = torch.cat([p[k].float() for p in parts])
        if world > 1:
            dist.all_reduce(full)  # rows of other ranks are zero here
        full = full.cpu()
        outs.append(full)
    return outs


def advantages(
    cfg: AlgorithmConfig,
    scores: torch.Tensor,
    kl: torch.Tensor,
    kl_coef: float,
    mask: torch.Tensor,
    values: torch.Tensor | None,
    group_size: int,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages, returns) per token. GAE and REINFORCE++ use token rewards (KL in the reward if so
    placed); outcome estimators score sequences (minus kl_coef * the sequence's KL if in the reward),
    with the samples not `valid` (B,) left out of their groups."""
    in_reward = cfg.kl_placement == KLPlacement.reward
    if cfg.estimator == Estimator.gae:
        rewards = A.token_rewards(scores, kl, kl_coef if in_reward else 0.0, mask)
        if cfg.whiten_rewards:
            rewards = A.masked_whiten(rewards, mask, shift_mean=False)
        adv, returns = A.compute_gae(rewards, values, mask, cfg.gamma, cfg.lam)
    elif cfg.estimator == Estimator.reinforce_pp:
        adv = L.reinforce_pp_returns(
            scores,
            kl,
            kl_coef if in_reward else 0.0,
            mask,
            cfg.gamma,
            group_size,
            valid,
            cfg.reinforce_pp_group_baseline,
        )
        returns = None
    else:
        seq_scores = scores - kl_coef * A.masked_sum(kl, mask, dim=-1) if in_reward else scores
        fn = A.OUTCOME_ESTIMATORS[cfg.estimator.value]
        options = {
            Estimator.grpo: {"scale_by_std": cfg.grpo_scale_by_std},
            Estimator.reinforce_baseline: {"baseline": cfg.reinforce_baseline.value},
        }.get(cfg.estimator, {})
        adv = fn(seq_scores, group_size, valid, **options)[:, None] * mask
        returns = None
    return normalize(cfg, adv, mask), returns


def normalize(cfg: AlgorithmConfig, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Batch normalisation of advantages. An outcome estimator that already subtracts a baseline
    (GRPO, RLOO, reinforce_baseline) is only rescaled by the batch std: a shift by the token-weighted
    batch mean would give an all-equal group a non-zero, length-weighted advantage. The others are
    whitened over every token of the batch: GAE, and REINFORCE++ with or without its group baseline,
    as Hu 2025 does (its returns carry per-token KL, so an all-equal group is not 0 there anyway).
    GRPO with its own std scaling is left as it is."""
    if not cfg.normalize_advantages or (cfg.estimator == Estimator.grpo and cfg.grpo_scale_by_std):
        return adv
    if has_baseline(cfg):
        return A.masked_rescale(adv, mask)
    return A.masked_whiten(adv, mask)


def has_baseline(cfg: AlgorithmConfig) -> bool:
    """True when the outcome estimator's advantages are already centred on a baseline (group or batch mean)."""
    return cfg.estimator in (Estimator.grpo, Estimator.rloo, Estimator.reinforce_baseline)


def single_pass(cfg: AlgorithmConfig, batch_size: int) -> bool:
    """True when the old logprobs cannot differ from the ones the update's own forward computes:
    one epoch, one mini-batch (one optimizer step, taken after every micro-batch's forward), and
    nothing needed before the update (no critic values, no KL in the reward). Then that forward's
    logprobs, detached, are the old ones (TRL's rule) and the recompute forward is skipped."""
    return (
        cfg.ppo_epochs == 1
        and cfg.mini_batch_size >= batch_size
        and cfg.estimator != Estimator.gae
        and cfg.kl_placement == KLPlacement.loss
    )


def make_experience(
    policy,
    critic,
    batch: RolloutBatch,
    scored: ScoredBatch,
    cfg: AlgorithmConfig,
    kl_coef: float,
    sampling: SamplerSettings,
    pad_id: int,
    micro: int,
    rank: int,
    world: int,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    device: torch.device = torch.device("cpu"),
    recompute: bool = True,
) -> Experience:
    """The experience stays on the CPU; each micro-batch goes to `device` (the models') for the forward.
    recompute=False (see single_pass): no forward here; old_logprobs and sampler_logprobs are zeros
    that the update fills from its own forward (Learner._train_mini_batch) before any metric reads them."""
    input_ids, attention_mask, position_ids, response_mask = pack(batch.prompt_ids, batch.response_ids, pad_id)
    valid = torch.tensor(scored.valid, dtype=torch.float32)[:, None]
    mask = response_mask * valid
    if batch.action_mask:  # multi-turn episodes: observation tokens get no gradient and no KL
        mask = mask * ragged_to_dense(batch.action_mask, response_mask)
    ref, behaviour = ragged_to_dense(scored.ref_logprobs, response_mask), ragged_to_dense(batch.logprobs, response_mask)
    scores = torch.tensor(scored.rewards, dtype=torch.float32)
    if not recompute:
        zeros = torch.zeros_like(mask)
        adv, _ = advantages(cfg, scores, zeros, kl_coef, mask, None, sampling.n_samples_per_prompt, valid[:, 0] > 0)
        return Experience(
            input_ids, attention_mask, position_ids, mask, zeros, ref, behaviour, zeros.clone(), None, adv, None
        )

    @torch.no_grad()
    def forward(rows):
        width = int(attention_mask[rows].sum(-1).max())  # these rows' own padding only (back to L-1 below)
        inputs = to_device((input_ids[rows, :width], attention_mask[rows, :width], position_ids[rows, :width]), device)
        logits, values = policy(*inputs)
        labels, t = inputs[0][:, 1:], sampling.temperature
        # chunk by chunk: no float32 (rows, L-1, V) copy of the logits (learner.logprob_chunk_tokens)
        logprobs = chunked_logprobs(logits, labels, t, chunk_tokens)
        filtered = (
            map_chunks(
                lambda x, y: filtered_logprobs(x, y, sampling.top_k, sampling.top_p), logits, labels, t, chunk_tokens
            )
            if filters
            else None
        )
        if critic is not None:
            values = critic(*inputs)
        pad = input_ids.shape[1] - width
        return tuple(None if x is None else torch.nn.functional.pad(x, (0, pad)) for x in (logprobs, values, filtered))

    filters = sampling.top_k > 0 or sampling.top_p < 1.0
    order = torch.argsort(attention_mask.sum(-1), descending=True, stable=True)  # micro-batches of similar lengths
    old_logprobs, old_values, filtered = sharded_forward(
        lambda rows: forward(order[rows]), len(batch), micro, rank, world, device
    )
    inverse = torch.argsort(order)
    old_logprobs, old_values, filtered = (
        None if x is None else x[inverse] for x in (old_logprobs, old_values, filtered)
    )
    old_logprobs = old_logprobs * response_mask
    kl = A.kl_penalty(old_logprobs, ref, cfg.kl_estimator.value, mask)
    needs_values = cfg.estimator == Estimator.gae
    adv, returns = advantages(
        cfg,
        scores,
        kl,
        kl_coef,
        mask,
        old_values if needs_values else None,
        sampling.n_samples_per_prompt,
        valid[:, 0] > 0,
    )
    sampler_logprobs = old_logprobs if filtered is None else torch.where(response_mask > 0, filtered, 0.0)
    return Experience(
        input_ids,
        attention_mask,
        position_ids,
        mask,
        old_logprobs,
        ref,
        behaviour,
        sampler_logprobs,
        old_values if needs_values else None,
        adv,
        returns,
    )


def experience_metrics(exp: Experience, algo: AlgorithmConfig, kl_coef: float) -> dict[str, float]:
    """The update's metrics of its inputs. With no token to train (every sample dropped), the KL to the
    reference is NaN, not 0: the adaptive controller skips a non-finite KL rather than shrink beta."""
    mask, o, nan = exp.mask, algo.off_policy, float("nan")
    kl = A.kl_penalty(exp.old_logprobs, exp.ref_logprobs, algo.kl_estimator.value, mask)
    empty = not bool(mask.any())
    # the sampler's and the learner's logprob of each sampled token, under the same top-k/top-p
    # filter; tokens the learner's filter excludes are counted apart, not averaged as -inf
    inside = A.filter_inside(exp.sampler_logprobs, mask)
    ratio = A.ratio_stats(
        exp.sampler_logprobs, exp.behaviour_logprobs, mask, o.correction.value, o.level.value, o.cap, o.low, o.high
    )
    m = {
        "kl/ref": nan if empty else float(A.masked_mean(kl, mask)),  # per token
        "kl/ref_seq": nan if empty else float(A.sequence_kl(kl, mask)),  # per sequence: what the controller steers
        "kl/coef": kl_coef,
        "rollout/logprob_gap": float(A.masked_mean((exp.sampler_logprobs - exp.behaviour_logprobs).abs(), inside)),
        "rollout/outside_filter_frac": float(1.0 - inside.sum() / mask.sum().clamp(min=1)),
        **{f"off_policy/{k}": v for k, v in ratio.items()},
        "advantages/mean": float(A.masked_mean(exp.advantages, mask)),
        "advantages/std": float(A.masked_var(exp.advantages, mask).sqrt()),
    }
    if exp.returns is not None:
        m["returns/mean"] = float(A.masked_mean(exp.returns, mask))
        m["learner/explained_variance"] = float(A.explained_variance(exp.old_values, exp.returns, mask))
    for name in nonfinite_inputs(exp):
        m[f"learner/nonfinite/{name}"] = 1.0
    return m


def nonfinite_inputs(exp: Experience) -> list[str]:
    """Names of the update's inputs with a NaN/inf on a training token: what a non-finite loss
    came from (e.g. old_logprobs at temperature 0, a NaN reward in advantages)."""
    names = ["old_logprobs", "ref_logprobs", "advantages", "old_values", "returns"]
    return [
        n
        for n in names
        if getattr(exp, n) is not None and not torch.isfinite(torch.where(exp.mask > 0, getattr(exp, n), 0.0)).all()
    ]
