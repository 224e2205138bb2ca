"""From a scored rollout batch to training tensors: old logprobs and values recomputed by the
learner, the KL to the reference, and advantages, all through learner/algorithms.py.

Every tensor is (B, L-1), aligned with the logits of the packed prompt+response sequences;
`mask` marks the response tokens of the samples that train.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from learner import algorithms as A
from learner.config import AlgorithmConfig, Estimator, KLPlacement
from learner.off_policy import filter_inside, ratio_stats
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch, pack, unpad
from runtime.device import to_device
from runtime.logprobs import DEFAULT_CHUNK_TOKENS, SamplerSettings, chunked_logprobs, filtered_logprobs, map_chunks


@dataclass
class Experience:
    """A scored rollout batch as the update trains on it (make_experience), on the CPU: the packed
    sequences, the learner's own old logprobs and values, the reference's and the sampler's logprobs,
    and the advantages and returns."""

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

    def rows(self, idx: torch.Tensor) -> MicroBatch:
        """Rows `idx`, without the padding columns all of them share (right padding: exact, and a
        micro-batch of short rows no longer pays for the batch's longest)."""
        width = int(self.attention_mask[idx].sum(-1).max())
        return MicroBatch(
            **{
                k: (v[idx, : width if k in FULL_WIDTH else width - 1] if isinstance(v, torch.Tensor) else v)
                for k, v in vars(self).items()
            }
        )

    def by_length(self, idx: torch.Tensor) -> torch.Tensor:
        """`idx` longest first: consecutive micro-batches then hold rows of similar length (bucketing)."""
        return idx[torch.argsort(self.attention_mask[idx].sum(-1), descending=True, stable=True)]


FULL_WIDTH = ("input_ids", "attention_mask", "position_ids")  # (B, L); every other tensor is (B, L-1)


@dataclass
class MicroBatch:
    """The rows one forward/backward trains on (Experience.rows): Experience's fields, trimmed to the
    rows' own width L (their longest sequence)."""

    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    position_ids: torch.Tensor  # (B, L)
    mask: torch.Tensor  # (B, L-1) response tokens of samples that train
    old_logprobs: torch.Tensor  # (B, L-1) the learner's own, before this update
    ref_logprobs: torch.Tensor  # (B, L-1)
    behaviour_logprobs: torch.Tensor  # (B, L-1) the sampler's
    sampler_logprobs: torch.Tensor  # (B, L-1) the learner's under the sampler's top-k/top-p filter
    old_values: torch.Tensor | None  # (B, L-1) critic estimates, or None without a critic
    advantages: torch.Tensor  # (B, L-1)
    returns: torch.Tensor | None  # (B, L-1) value targets, or None without a critic

    def to(self, device: torch.device) -> MicroBatch:
        """Every tensor on `device` (through to_device, the one place inputs move)."""
        return MicroBatch(**to_device(vars(self), device))


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
    """(advantages, returns) per token from cfg.estimator's function (algorithms.ESTIMATORS), then
    normalised. GAE and REINFORCE++ use token rewards (KL in the reward if so placed); outcome
    estimators score sequences (minus kl_coef * the sequence's KL if in the reward), with the samples
    not `valid` (B,) left out of their groups."""
    x = A.EstimatorInput(scores, kl, kl_coef, cfg.kl_placement == KLPlacement.reward, mask, values, group_size, valid)
    adv, returns = A.ESTIMATORS[cfg.estimator.value](x, **estimator_options(cfg))
    return normalize(cfg, adv, mask), returns


def estimator_options(cfg: AlgorithmConfig) -> dict:
    """cfg.estimator's options, from its own sub-section (algorithm.gae, algorithm.grpo, ...)."""
    return {
        Estimator.gae: {"gamma": cfg.gae.gamma, "lam": cfg.gae.lam, "whiten_rewards": cfg.gae.whiten_rewards},
        Estimator.grpo: {"scale_by_std": cfg.grpo.scale_by_std},
        Estimator.rloo: {},
        Estimator.reinforce_baseline: {"baseline": cfg.reinforce_baseline.baseline.value},
        Estimator.reinforce_pp: {"gamma": cfg.reinforce_pp.gamma, "group_baseline": cfg.reinforce_pp.group_baseline},
    }[cfg.estimator]


def normalize(cfg: AlgorithmConfig, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Batch normalisation of advantages. An outcome estimator that already subtracts a baseline
    (GRPO, RLOO, reinforce_baseline) is only rescaled by the batch std: a shift by the token-weighted
    batch mean would give an all-equal group a non-zero, length-weighted advantage. The others are
    whitened over every token of the batch: GAE, and REINFORCE++ with or without its group baseline,
    as Hu 2025 does (its returns carry per-token KL, so an all-equal group is not 0 there anyway).
    GRPO with its own std scaling is left as it is."""
    if not cfg.normalize_advantages or (cfg.estimator == Estimator.grpo and cfg.grpo.scale_by_std):
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
        and not cfg.needs_critic
        and cfg.kl_placement == KLPlacement.loss
    )


@dataclass
class ForwardSettings:
    """How make_experience runs the learner's no-grad forward over a batch, and reads its output."""

    sampling: SamplerSettings  # the sampler's temperature, top-k/top-p filter and samples per prompt
    pad_id: int  # the tokenizer's padding id
    micro: int  # rows per forward
    rank: int  # this learner rank
    world: int  # learner ranks
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # tokens whose logits are upcast to float32 at once
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # the models'


def make_experience(
    policy,
    critic,
    batch: RolloutBatch,
    scored: ScoredBatch,
    cfg: AlgorithmConfig,
    kl_coef: float,
    run: ForwardSettings,
    recompute: bool = True,
) -> Experience:
    """The experience stays on the CPU; each micro-batch goes to `run.device` (the models') for the forward.
    recompute=False (see single_pass): no forward here; old_logprobs and sampler_logprobs are zeros
    that the update fills from its own forward (Learner._train_mini_batch) before any metric reads them."""
    input_ids, attention_mask, position_ids, response_mask = pack(batch.prompt_ids, batch.response_ids, run.pad_id)
    valid = torch.tensor(scored.valid, dtype=torch.float32)[:, None]
    mask = response_mask * valid
    if batch.action_mask:  # multi-turn episodes: observation tokens get no gradient and no KL
        mask = mask * ragged_to_dense(batch.action_mask, response_mask)
    ref, behaviour = ragged_to_dense(scored.ref_logprobs, response_mask), ragged_to_dense(batch.logprobs, response_mask)
    scores = torch.tensor(scored.rewards, dtype=torch.float32)
    group_size = run.sampling.n_samples_per_prompt
    if not recompute:
        zeros = torch.zeros_like(mask)
        adv, _ = advantages(cfg, scores, zeros, kl_coef, mask, None, group_size, valid[:, 0] > 0)
        return Experience(
            input_ids, attention_mask, position_ids, mask, zeros, ref, behaviour, zeros.clone(), None, adv, None
        )
    old_logprobs, old_values, filtered = old_outputs(policy, critic, (input_ids, attention_mask, position_ids), run)
    old_logprobs = old_logprobs * response_mask
    kl = A.kl_penalty(old_logprobs, ref, cfg.kl_estimator.value, mask)
    needs_values = cfg.needs_critic
    adv, returns = advantages(
        cfg, scores, kl, kl_coef, mask, old_values if needs_values else None, group_size, valid[:, 0] > 0
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


def old_outputs(
    policy, critic, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor], run: ForwardSettings
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The learner's own (old_logprobs, old_values or None, sampler-filtered logprobs or None), each
    (B, L-1), from one no-grad forward over `packed` (input_ids, attention_mask, position_ids (B, L)),
    sharded over the ranks in micro-batches of similar lengths."""
    input_ids, attention_mask, position_ids = packed
    sampling, chunk_tokens, device = run.sampling, run.chunk_tokens, run.device

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
    outputs = sharded_forward(lambda rows: forward(order[rows]), len(input_ids), run.micro, run.rank, run.world, device)
    inverse = torch.argsort(order)
    return tuple(None if x is None else x[inverse] for x in outputs)


def reference_logprobs(policy, lm, batch: RolloutBatch, run: ForwardSettings) -> list[list[float]]:
    """The reference policy's logprob of each response token, when it is the LoRA policy's base: the learner's
    own forward (old_outputs: its function, micro-batches and ranks) with the adapter of `lm` (the PeftModel)
    disabled, unfiltered as the scoring service's reference is (reward_service/reference.py)."""
    input_ids, attention_mask, position_ids, response_mask = pack(batch.prompt_ids, batch.response_ids, run.pad_id)
    plain = replace(run, sampling=replace(run.sampling, top_k=-1, top_p=1.0))
    with lm.disable_adapter():
        logprobs, _, _ = old_outputs(policy, None, (input_ids, attention_mask, position_ids), plain)
    return unpad(logprobs * response_mask, response_mask)


def experience_metrics(exp: Experience, algo: AlgorithmConfig, kl_coef: float) -> dict[str, float]:
    """The update's metrics of its inputs. With no token to train (every sample dropped), the KL to the
    reference is NaN, not 0: the adaptive controller skips a non-finite KL rather than shrink beta."""
    mask, o, nan = exp.mask, algo.off_policy, float("nan")
    kl = A.kl_penalty(exp.old_logprobs, exp.ref_logprobs, algo.kl_estimator.value, mask)
    empty = not bool(mask.any())
    # the sampler's and the learner's logprob of each sampled token, under the same top-k/top-p
    # filter; tokens the learner's filter excludes are counted apart, not averaged as -inf
    inside = filter_inside(exp.sampler_logprobs, mask)
    ratio = ratio_stats(exp.sampler_logprobs, exp.behaviour_logprobs, mask, o.kind, o.level.value, o.cap, o.low, o.high)
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
