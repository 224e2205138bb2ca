"""Invariant sweeps (unit tier: no Ray, no model, small synthetic batches): the promises relay makes in
every combination of estimator x policy loss x loss aggregation x off-policy correction x named recipe
x mask shape x seed, checked through the functions the learner calls (learner.experience.advantages,
learner.micro_batch_loss.policy_loss and micro_metrics, learner.engine.update_metrics).

Mask shapes: "single_turn" (right padding of ragged responses, one invalid sample whose row is all 0)
and "episode" (the same, with observation tokens inside the responses masked out, as
RolloutBatch.action_mask makes them). Masked positions hold garbage (inf, nan, huge numbers).
"""

import asyncio
import itertools
import json
import math
import operator

import pytest
import torch

from learner import algorithms as A
from learner.config import (
    AlgorithmConfig,
    Baseline,
    Estimator,
    GRPOConfig,
    KLPlacement,
    LossAggregation,
    Method,
    OffPolicyConfig,
    OffPolicyKind,
    PolicyLoss,
    RatioLevel,
    ReinforceBaselineConfig,
    ReinforcePPConfig,
)
from learner.engine import update_metrics
from learner.experience import MicroBatch, advantages
from learner.micro_batch_loss import LossSettings, micro_metrics, policy_loss
from learner.off_policy import off_policy_weights, ratio_stats
from orchestrator.config.methods import RECIPES
from orchestrator.config.schema import DataConfig
from orchestrator.data.prompts import PromptSampler, load_split
from orchestrator.data.tasks import ONE_PROMPT_TASKS, TINY_TASKS
from reward_service.combine import SourceRun, combine
from rollout.config import SamplingConfig
from runtime.logprobs import entropy_from_logits, logprobs_from_logits
from runtime.seeds import EVALUATION, stream_seed
from tests.helpers import make_micro_batch

B, T, V, GROUP = 8, 7, 5, 4  # 2 groups of 4 samples; the second group is all equal where a test wants it
SEEDS = [0, 1, 2]
SHAPES = ["single_turn", "episode"]
AGGS = list(LossAggregation)
LOSSES = list(PolicyLoss)
CORRECTIONS = [c for c in OffPolicyKind if c not in (OffPolicyKind.none, OffPolicyKind.auto)]  # auto: at launch


def recipe(method: Method, **extra) -> AlgorithmConfig:
    """The AlgorithmConfig algorithm.method=method builds (its algorithm.* keys; data.* ones aside)."""
    keys = {k.removeprefix("algorithm."): v for k, v in RECIPES[method].items() if k.startswith("algorithm.")}
    cfg = AlgorithmConfig(method=method, **{k: v for k, v in keys.items() if "." not in k}, **extra)
    for key, value in keys.items():  # sub-section keys (grpo.scale_by_std, cispo.clip_low)
        section, _, name = key.rpartition(".")
        if section and section.split(".")[0] not in extra:  # as above, what `extra` gives wins
            setattr(operator.attrgetter(section)(cfg), name, value)
    return cfg


# named recipes whose advantages promise an all-equal group 0: group-centred, KL (if any) in the loss
ZERO_RECIPES = [m for m in Method if RECIPES[m].get("algorithm.estimator") == Estimator.grpo]

# estimators whose advantage is centred on a group mean: an all-equal group gets exactly 0 (KL not in the
# reward). Not REINFORCE++-baseline: whitened over the batch, mean included, as its paper (docs/algorithms.md)
GROUP_CENTRED = {
    "grpo": dict(estimator=Estimator.grpo),
    "grpo_no_std": dict(estimator=Estimator.grpo, grpo=GRPOConfig(scale_by_std=False)),
    "rloo": dict(estimator=Estimator.rloo),
    "reinforce_baseline_group": dict(
        estimator=Estimator.reinforce_baseline, reinforce_baseline=ReinforceBaselineConfig(Baseline.group)
    ),
}


def masks(shape: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask (B, T) of the tokens that train, valid (B,)): sample 2 is invalid (reward.invalid: drop)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    if shape == "episode":  # an observation of 1-2 tokens after the first model turn
        for i in range(B):
            start = int(torch.randint(1, max(int(lengths[i]) - 1, 2), (1,), generator=g))
            mask[i, start : start + 1 + i % 2] = 0.0
            mask[i, 0] = 1.0
    valid = torch.ones(B, dtype=torch.bool)
    valid[2] = False
    return mask * valid[:, None], valid


def garbage(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """x with masked positions overwritten by values that poison any sum they leak into."""
    junk = torch.tensor([math.inf, -math.inf, math.nan, 1e30])[torch.arange(x.numel()) % 4].view_as(x)
    return torch.where(mask > 0, x, junk.roll(seed))


def scores(seed: int, all_equal_second_group: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    s = torch.randint(0, 3, (B,), generator=g).float()
    if all_equal_second_group:
        s[GROUP:] = 1.0
    return s


# ---------------------------------------------------------------- an all-equal group gets exactly 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("name", sorted(GROUP_CENTRED))
def test_an_all_equal_group_gets_exactly_zero_advantage(name, normalize, shape, seed):
    cfg = AlgorithmConfig(**GROUP_CENTRED[name], normalize_advantages=normalize, kl_placement=KLPlacement.loss)
    mask, valid = masks(shape, seed)
    kl = torch.rand(B, T, generator=torch.Generator().manual_seed(seed))  # in the loss: must not enter advantages
    adv, _ = advantages(cfg, scores(seed, True), kl, 0.1, mask, None, GROUP, valid)
    assert torch.equal(adv[GROUP:], torch.zeros(GROUP, T))
    assert torch.isfinite(adv).all() and torch.equal(adv[mask == 0], torch.zeros(int((mask == 0).sum())))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method", ZERO_RECIPES)
def test_a_named_recipe_gives_an_all_equal_group_exactly_zero(method, shape, seed):
    cfg = recipe(method)
    mask, valid = masks(shape, seed)
    kl = torch.rand(B, T, generator=torch.Generator().manual_seed(seed))
    adv, _ = advantages(cfg, scores(seed, True), kl, 0.1, mask, None, GROUP, valid)
    assert torch.equal(adv[GROUP:], torch.zeros(GROUP, T)) and adv[:GROUP].abs().sum() > 0


# ---------------------------------------------------------------- a failure is never a score


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "name", sorted(GROUP_CENTRED) + ["reinforce_baseline_batch", "reinforce_pp", "reinforce_pp_group_baseline"]
)
def test_an_invalid_samples_score_changes_no_advantage(name, seed):
    """A sample no source could judge (valid False) is out of every baseline and the normalisation:
    whatever score it carries, every advantage is the same."""
    kw = {
        "reinforce_baseline_batch": dict(
            estimator=Estimator.reinforce_baseline, reinforce_baseline=ReinforceBaselineConfig(Baseline.batch)
        ),
        "reinforce_pp": dict(estimator=Estimator.reinforce_pp),
        "reinforce_pp_group_baseline": dict(
            estimator=Estimator.reinforce_pp, reinforce_pp=ReinforcePPConfig(group_baseline=True)
        ),
    }.get(name) or GROUP_CENTRED[name]
    cfg = AlgorithmConfig(**kw, kl_placement=KLPlacement.loss)
    mask, valid = masks("single_turn", seed)
    s = scores(seed, False)
    zero = torch.zeros(B, T)
    low, _ = advantages(cfg, s, zero, 0.0, mask, None, GROUP, valid)
    s[2] = 1e6  # the invalid sample
    high, _ = advantages(cfg, s, zero, 0.0, mask, None, GROUP, valid)
    assert torch.equal(low, high) and torch.equal(low[2], torch.zeros(T))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_failed_source_marks_the_sample_invalid_and_never_adds_a_score(seed):
    g = torch.Generator().manual_seed(seed)
    runs = {
        name: SourceRun(
            [None if torch.rand(1, generator=g) < 0.3 else float(torch.rand(1, generator=g)) for _ in range(B)]
        )
        for name in ("a", "b")
    }
    total, invalid = combine(runs, {"a": 1.0, "b": 0.5})
    for i in range(B):
        failed = runs["a"].scores[i] is None or runs["b"].scores[i] is None
        assert invalid[i] == failed
        if not failed:
            assert total[i] == pytest.approx(runs["a"].scores[i] + 0.5 * runs["b"].scores[i])


@pytest.mark.parametrize("seed", SEEDS)
def test_a_weight_zero_source_changes_nothing(seed):
    g = torch.Generator().manual_seed(seed)

    def draw(p):
        return [None if torch.rand(1, generator=g) < p else float(torch.rand(1, generator=g)) for _ in range(B)]

    trained = {"rm": SourceRun(draw(0.2))}
    reported = SourceRun(draw(0.5))  # fails on about half the samples: a metric, it must not matter
    assert combine(trained | {"math": reported}, {"rm": 1.0, "math": 0.0}) == combine(trained, {"rm": 1.0})


# ---------------------------------------------------------------- masked tokens get exactly zero gradient


def micro_batch(shape: str, seed: int, requires_grad: bool = True):
    g = torch.Generator().manual_seed(seed)
    mask, _ = masks(shape, seed)
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    lp = logprobs_from_logits(logits, ids[:, 1:])
    mb = make_micro_batch(
        ids,
        mask,
        old_logprobs=garbage(lp + 0.3 * torch.randn(B, T, generator=g), mask, seed),
        ref_logprobs=garbage(lp + 0.3 * torch.randn(B, T, generator=g), mask, seed + 1),
        advantages=garbage(torch.randn(B, T, generator=g), mask, seed + 2),
    )
    # the sampler's logprobs, and the learner's under its filter: -inf on one response token per row
    # (a token the sampler kept that the learner's filter excludes)
    mb.behaviour_logprobs = garbage(lp + 0.2 * torch.randn(B, T, generator=g), mask, seed + 3)
    sampler = lp.clone()
    sampler[torch.arange(B), mask.argmax(-1)] = -math.inf  # rows with no token: on padding anyway
    mb.sampler_logprobs = garbage(sampler, mask, seed + 4)
    return logits.requires_grad_(requires_grad), mb


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("loss", LOSSES)
def test_masked_tokens_get_exactly_zero_gradient(loss, agg, shape, seed):
    """Padding, observation tokens and invalid samples: no gradient at all reaches their logits, whatever
    garbage their old/ref logprobs and advantages hold (KL in the loss and an entropy bonus included)."""
    logits, mb = micro_batch(shape, seed)
    cfg = AlgorithmConfig(policy_loss=loss, loss_aggregation=agg, kl_placement=KLPlacement.loss, entropy_coef=0.01)
    total = A.aggregate_total(mb.mask, agg.value)
    out, _ = policy_loss(logits, mb, cfg, 0.1, LossSettings(0.7, 4, total, agg.value, norm_tokens=T))
    out.backward()
    masked = mb.mask == 0
    assert torch.isfinite(out) and torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad[masked], torch.zeros(int(masked.sum()), V))
    assert logits.grad[~masked].abs().sum() > 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("level", list(RatioLevel))
@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("one_pass", [False, True])
def test_masked_tokens_get_exactly_zero_gradient_under_off_policy_correction(one_pass, correction, level, shape, seed):
    """The same with a correction on: the sampler-filtered logprobs (-inf on a response token; one_pass:
    the forward's own under top-k 2, -inf wherever the label is outside it) never leak a NaN."""
    logits, mb = micro_batch(shape, seed)
    cfg = AlgorithmConfig(kl_placement=KLPlacement.loss, off_policy=OffPolicyConfig(correction=correction, level=level))
    total = A.aggregate_total(mb.mask, "token_mean")
    out, _ = policy_loss(
        logits, mb, cfg, 0.1, LossSettings(0.7, 4, total, "token_mean", old_from_forward=one_pass, top_k=2)
    )
    out.backward()
    masked = mb.mask == 0
    assert torch.isfinite(out) and torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad[masked], torch.zeros(int(masked.sum()), V))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", [m for m in Method if m != Method.none])
def test_every_named_recipe_gets_no_gradient_on_masked_tokens_with_its_kl(method, seed):
    logits, mb = micro_batch("episode", seed)
    cfg = recipe(method, entropy_coef=0.01)
    agg = cfg.loss_aggregation.value
    out, _ = policy_loss(
        logits, mb, cfg, 0.1, LossSettings(0.7, 4, A.aggregate_total(mb.mask, agg), agg, norm_tokens=T)
    )
    out.backward()
    masked = mb.mask == 0
    assert torch.isfinite(out) and torch.equal(logits.grad[masked], torch.zeros(int(masked.sum()), V))
    assert logits.grad[~masked].abs().sum() > 0


# ---------------------------------------------------------------- a token outside the learner's filter


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", list(RatioLevel))
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_a_token_outside_the_learners_filter_gets_weight_zero_counts_cut_and_leaves_the_rest(correction, level, seed):
    """In sync mode mu = pi_prox on every token inside the filter; one token per row is outside
    (pi_prox -inf). That token: weight 0, counted in clipped_frac; every other token: ratio 1, weight
    1 (its sequence's ratio is over the inside tokens only); ratio_mean 1."""
    mask, _ = masks("single_turn", seed)
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(B, T, generator=g) - 2.0
    prox = mu.clone()
    prox[torch.arange(B), mask.argmax(-1)] = -math.inf
    outside = (mask > 0) & ~torch.isfinite(prox)
    w = off_policy_weights(prox, mu, mask, correction.value, level.value, 2.0, 0.5, 2.0)
    assert torch.equal(w[outside], torch.zeros(int(outside.sum())))
    assert torch.allclose(w[(mask > 0) & ~outside], torch.ones(int(((mask > 0) & ~outside).sum())))
    stats = ratio_stats(prox, mu, mask, correction.value, level.value, 2.0, 0.5, 2.0)
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["ratio_max"] == pytest.approx(1.0)
    assert stats["clipped_frac"] == pytest.approx(float(outside.sum() / mask.sum()))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("agg", AGGS)
def test_masked_tokens_get_no_value_gradient(agg, shape, seed):
    g = torch.Generator().manual_seed(seed)
    mask, _ = masks(shape, seed)
    values = torch.randn(B, T, generator=g).requires_grad_(True)
    old, returns = (garbage(torch.randn(B, T, generator=g), mask, seed + k) for k in (0, 1))
    loss, _ = A.ppo_value_loss(values, old, returns, mask, 0.2, agg.value, A.aggregate_total(mask, agg.value), T)
    loss.backward()
    assert torch.isfinite(loss) and torch.equal(values.grad[mask == 0], torch.zeros(int((mask == 0).sum())))


# ---------------------------------------------------------------- one unit per metric, every aggregation


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("loss", LOSSES)
def test_every_metric_is_a_per_token_mean_over_the_update_in_every_aggregation(loss, shape, seed):
    """entropy, KL, clip fraction and approx KL: one value whatever the aggregation and however the
    rows fall into mini-batches (here 7 + 1, as a 33-row endpoint batch in mini-batches of 32): the
    mean over every response token of the update, through the learner's micro_metrics and
    update_metrics, as Learner._policy_loss and _reduce use them."""
    logits, mb = micro_batch(shape, seed, requires_grad=False)
    mask = mb.mask
    lp = logprobs_from_logits(logits / 0.7, mb.input_ids[:, 1:])
    want = {
        "learner/entropy": A.masked_mean(entropy_from_logits(logits / 0.7, mask), mask),
        "loss/kl": A.masked_mean(A.kl_penalty(lp, mb.ref_logprobs, "k3", mask), mask),
    }
    ratio = (lp - mb.old_logprobs).where(mask > 0, 0.0)
    want["learner/approx_kl"] = A.masked_mean(ratio.exp() - 1 - ratio, mask)
    seen = []
    for agg in AGGS:
        cfg = AlgorithmConfig(policy_loss=loss, loss_aggregation=agg, kl_placement=KLPlacement.loss)
        sums: dict[str, float] = {}
        for mini in (range(0, 7), range(7, 8)):
            total = A.aggregate_total(mask[list(mini)], agg.value)
            for rows in (slice(mini.start, mini.start + 3), slice(mini.start + 3, mini.stop)):  # micro-batches
                part = MicroBatch(**{k: v if v is None else v[rows] for k, v in vars(mb).items()})
                if not len(part.mask):
                    continue
                _, terms = policy_loss(
                    logits[rows], part, cfg, 0.1, LossSettings(0.7, 4, total, agg.value, norm_tokens=T)
                )
                for k, v in micro_metrics(terms, part.mask).items():
                    sums[k] = sums.get(k, 0.0) + v
        got = update_metrics(sums, 2)
        seen.append({k: got[k] for k in ("learner/entropy", "loss/kl", "learner/clip_frac", "learner/approx_kl")})
        for k, v in want.items():
            assert got[k] == pytest.approx(float(v), rel=1e-5, abs=1e-7), (agg, k)
    for other in seen[1:]:
        assert other == pytest.approx(seen[0], rel=1e-5, abs=1e-7)


# ---------------------------------------------------------------- a different seed, a different stream


def run_streams(run_seed: int) -> dict[str, list]:
    """What each random stream of a run draws first, through the code that draws it: the engines'
    request seeds (RolloutWorker._request_seed, per step, draw and prompt), data order (PromptSampler),
    generated task data and the held-out draw (load_split), environments (RolloutWorker._episodes:
    what reset gets), and the learner's init and mini-batch streams (named in learner/worker.py)."""
    from rollout.worker import RolloutWorker  # imports vLLM: only here

    worker = object.__new__(RolloutWorker)
    worker.seed = run_seed
    train, held_out, _ = load_split(DataConfig(task="addition_2digit", task_size=64, eval_size=16), run_seed)
    return {
        "sampling": [
            worker._request_seed(SamplingConfig(), (step, draw), index)
            for step in range(2)
            for draw in (EVALUATION, 0, 8)
            for index in range(4)
        ],
        "data_order": PromptSampler(64, run_seed, shuffle=True).next(64),
        "task": [e["prompt"] for e in train],
        "held_out": [e["prompt"] for e in held_out],
        "env": env_reset_seeds(worker),
        "learner": [stream_seed(run_seed, "learner", rank) for rank in range(2)],
        "mini_batches": [stream_seed(run_seed, "mini_batches", step, epoch) for step in range(2) for epoch in range(2)],
    }


def env_reset_seeds(worker) -> list[int]:
    """The seed every episode's reset got, on a scripted one-turn engine."""
    from types import SimpleNamespace

    from envs.base import Environment
    from envs.config import EnvConfig
    from learner.tiny_gpt import char_tokenizer
    from rollout.config import RolloutConfig

    seen = []

    class Records(Environment):
        def reset(self, task, seed):
            seen.append(seed)

        def step(self, action):
            return None, 0.0, True, {}

    done = SimpleNamespace(token_ids=[5], logprobs=[{5: SimpleNamespace(logprob=-0.5)}], finish_reason="stop", text="")

    async def generate(prompt_ids, params):
        return [SimpleNamespace(outputs=[done]) for _ in prompt_ids]

    worker.engine = SimpleNamespace(generate=generate, version=0)
    worker.cfg, worker.tokenizer = RolloutConfig(max_prompt_tokens=16), char_tokenizer()
    worker.env, worker.env_factory = EnvConfig(name="records", max_turns=1), Records
    asyncio.run(
        worker._episodes(["1+1="] * 3, [{"answer": "2"}] * 3, (1, 8), 0, False, SamplingConfig(n_samples_per_prompt=2))
    )
    return seen


@pytest.fixture(scope="module")
def streams():
    return {seed: run_streams(seed) for seed in SEEDS + [7]}


@pytest.mark.parametrize("a, b", list(itertools.combinations(SEEDS + [7], 2)))
def test_different_run_seeds_draw_different_streams_and_one_seed_the_same(streams, a, b):
    assert run_streams(a) == streams[a]  # the same seed: the same streams, in a fresh run
    for name, first in streams[a].items():
        assert first != streams[b][name], name
        if name not in ("data_order", "task", "held_out"):  # seeds: none shared between two runs
            assert not set(first) & set(streams[b][name]), name
    assert len(set(streams[a]["sampling"])) == len(streams[a]["sampling"])  # every draw and step its own seeds
    assert len(set(streams[a]["env"])) == len(streams[a]["env"])  # every episode its own environment seed


# ---------------------------------------------------------------- held-out and training sets are disjoint


def prompt_set(rows) -> set[str]:
    return {json.dumps(r["prompt"], sort_keys=True) for r in rows}


@pytest.mark.parametrize("seed", SEEDS + [7])
@pytest.mark.parametrize("task", sorted({*TINY_TASKS, *ONE_PROMPT_TASKS}))
def test_held_out_and_training_sets_are_disjoint_for_every_builtin_task(task, seed):
    train, held_out, _ = load_split(DataConfig(task=task, task_size=500, eval_size=64), seed)
    assert len(train) == 500 and len(held_out) == 64
    if task in ONE_PROMPT_TASKS:  # one prompt: the held-out set is fresh episodes, of its own stream
        assert [e["answer"] for e in held_out] != [e["answer"] for e in train[:64]]
        return
    assert not prompt_set(train) & prompt_set(held_out) and len(prompt_set(held_out)) == 64
    # and of every other seed's training set: held-out membership is per prompt (tasks.reserved), not per seed
    for other in SEEDS:
        assert not prompt_set(load_split(DataConfig(task=task, task_size=500, eval_size=64), other)[0]) & prompt_set(
            held_out
        )


@pytest.mark.parametrize("seed", SEEDS)
def test_held_out_and_training_sets_are_disjoint_for_a_file(tmp_path, seed):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i % 40}+1="}) + "\n" for i in range(100)))  # repeated lines
    train, held_out, _ = load_split(DataConfig(train_files=[str(path)], eval_size=10), seed)
    assert not prompt_set(train) & prompt_set(held_out) and len(prompt_set(held_out)) == 10
