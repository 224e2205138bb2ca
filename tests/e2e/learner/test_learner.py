"""The DeepSpeed learner on a real tiny model, as Ray actors: updates, ZeRO invariance, critics,
LoRA, non-finite batches, and bit-identical resume."""

import math

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from learner import algorithms as A
from learner.config import (
    AlgorithmConfig,
    Dtype,
    Estimator,
    GAEConfig,
    LearnerConfig,
    LoraConfig,
    OptimizerKind,
    Precision,
    ValueHead,
)
from learner.group import LearnerGroup, RankPlacement
from runtime.logprobs import SamplerSettings
from tests.helpers import make_scored_batch, tiny_learner

pytestmark = pytest.mark.e2e
GROUP = 4


def algo(**kw):
    base = dict(estimator=Estimator.grpo, mini_batch_size=8, micro_batch_size=4, ppo_epochs=1, init_kl_coef=0.01)
    return AlgorithmConfig(**(base | kw))


def learners(model, world=1, zero=0, a=None, **cfg_kw):
    return tiny_learner(model, world, zero, lr=1e-3, algo=a or algo(), group=GROUP, **cfg_kw)


def changed(a: dict, b: dict) -> set[str]:
    return {k for k in a if not torch.equal(a[k], b[k])}


def update_once(group, batch, scored):
    """One update; the weights before and after, its metrics, the batch's response mask and the
    PPO surrogate on the batch before (ratio 1) and after it."""
    try:
        before, lp0 = group.policy_state(), group.policy_logprobs(batch)
        metrics = group.update(batch, scored, step=0)
        after, lp1 = group.policy_state(), group.policy_logprobs(batch)
    finally:
        group.shutdown()
    old, mask = batch.padded(0)[1] * 0, batch.padded(0)[2]
    new = torch.zeros_like(old)
    for i, (row0, row1) in enumerate(zip(lp0, lp1)):
        old[i, : len(row0)], new[i, : len(row1)] = torch.tensor(row0), torch.tensor(row1)
    adv = A.grpo_advantages(torch.tensor(scored.rewards), GROUP)[:, None] * mask  # GRPO's own scale, not re-whitened
    surrogate = [A.ppo_policy_loss(A.PolicyLossInput(lp, old, adv, mask), 0.2)[0] for lp in (old, new)]
    return before, after, metrics, mask, surrogate


def test_one_update_changes_parameters_and_lowers_the_surrogate_loss(ray_cluster, tiny_model):
    batch, scored = make_scored_batch(tiny_model, seed=1)
    before, after, metrics, mask, (loss_before, loss_after) = update_once(learners(tiny_model), batch, scored)
    assert changed(before, after)
    assert loss_after < loss_before - 0.01
    # the controller's KL is per sequence: the per-token mean times tokens per sample
    assert metrics["kl/ref_seq"] == pytest.approx(metrics["kl/ref"] * float(mask.sum()) / len(batch), rel=1e-5)
    for key in (
        "loss/policy",
        "learner/entropy",
        "learner/approx_kl",
        "learner/clip_frac",
        "learner/grad_norm",
        "kl/ref",
        "kl/coef",
        "advantages/mean",
        "learner/tokens_per_s",
    ):
        assert math.isfinite(metrics[key]), key
    assert metrics["learner/grad_norm"] > 0 and metrics["learner/skipped_steps"] == 0


@pytest.mark.parametrize("precision", [Precision.autocast, Precision.master_weights])
def test_a_bf16_grpo_update_runs_and_lowers_the_surrogate_loss(ray_cluster, tiny_model, precision):
    """learner.dtype bfloat16, autocast over float32 weights or bf16 weights over float32 masters (ZeRO 2):
    chunked logprobs from bf16 logits train as fp32 do, and the weights (what the engines get) are float32 or
    bf16 as the precision says."""
    batch, scored = make_scored_batch(tiny_model, seed=1)
    # several logprob chunks per micro-batch
    group = learners(tiny_model, dtype=Dtype.bfloat16, logprob_chunk_tokens=16, precision=precision)
    assert group.describe()["zero_stage"] == (2 if precision == Precision.master_weights else 0)
    weights = torch.bfloat16 if precision == Precision.master_weights else torch.float32
    before, after, metrics, mask, (loss_before, loss_after) = update_once(group, batch, scored)
    assert all(v.dtype == weights for v in after.values()) and changed(before, after)
    assert loss_after < loss_before - 0.01
    for key in ("loss/policy", "learner/entropy", "loss/kl", "learner/grad_norm"):
        assert math.isfinite(metrics[key]), key
    assert metrics["learner/skipped_steps"] == 0


@pytest.fixture(scope="module")
def zero_batch(tiny_model):
    return make_scored_batch(tiny_model, seed=2)


@pytest.fixture(scope="module")
def global_result(ray_cluster, tiny_model, zero_batch):
    """One GRPO rank without ZeRO: the update every sharded one must equal, and what the rank built."""
    group = learners(tiny_model, world=1, zero=0)
    try:
        metrics = group.update(*zero_batch, step=0)
        return group.policy_state(), metrics, group.describe()
    finally:
        group.shutdown()


@pytest.mark.parametrize("world, zero", [(1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3)])
def test_sharded_update_equals_the_global_one(ray_cluster, tiny_model, zero_batch, global_result, world, zero):
    """ZeRO stage and rank count change how the work is split, not the result (fp32, stated tolerance)."""
    want_state, want_metrics, _ = global_result
    group = learners(tiny_model, world=world, zero=zero)
    try:
        metrics = group.update(*zero_batch, step=0)
        state = group.policy_state()
    finally:
        group.shutdown()
    worst = max(float((state[k] - want_state[k]).abs().max()) for k in want_state)
    assert worst < 2e-5, f"max |param difference| {worst:.2e}"
    for key in ("loss/policy", "learner/entropy", "loss/kl"):
        assert metrics[key] == pytest.approx(want_metrics[key], abs=1e-5), key


def short_last_update(model: str, batch, scored, world: int, zero: int) -> dict:
    """The weights after one update of 33 rows in mini-batches of 32 + 1, on `world` ranks."""
    group = tiny_learner(model, world, zero, lr=1e-3, algo=algo(mini_batch_size=32, micro_batch_size=8), group=3)
    try:
        group.update(batch, scored, step=0)
        return group.policy_state()
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def short_last(ray_cluster, tiny_model):
    """The batch of 33 rows, and one rank's weights after its update (each ZeRO case compares with them)."""
    batch, scored = make_scored_batch(tiny_model, n_prompts=11, group=3, seed=10)
    return batch, scored, short_last_update(tiny_model, batch, scored, world=1, zero=0)


@pytest.mark.parametrize("zero", [0, 2])
def test_a_short_last_mini_batch_trains_the_same_on_two_ranks(tiny_model, short_last, zero):
    """33 rows, mini-batches of 32 + 1: on two ranks the 1-row mini-batch leaves rank 1 without rows,
    which makes a zero-weight pass so the ranks' collectives pair up; the result is one rank's."""
    batch, scored, one = short_last
    two = short_last_update(tiny_model, batch, scored, world=2, zero=zero)
    worst = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert worst < 2e-5, f"max |param difference| {worst:.2e}"


@pytest.mark.parametrize("value_head", [ValueHead.shared, ValueHead.separate])
def test_both_critics_train(ray_cluster, tiny_model, value_head):
    batch, scored = make_scored_batch(tiny_model, seed=3)
    group = learners(
        tiny_model,
        a=algo(estimator=Estimator.gae, gae=GAEConfig(value_clip_eps=10.0, vf_coef=1.0)),
        value_head=value_head,
        critic_lr=3e-3,
    )
    try:
        built = group.describe()
        losses = [group.update(batch, scored, step=s)["loss/value"] for s in range(6)]
    finally:
        group.shutdown()
    assert built["critic"] == (value_head == ValueHead.separate) and built["value_head"] == (
        value_head == ValueHead.shared
    )
    assert losses[-1] < 0.5 * losses[0], losses


def test_grpo_builds_no_critic(global_result):
    built = global_result[2]
    assert built["critic"] is False and built["value_head"] is False
    assert not any("value" in n for n in built["trainable"])


def test_lora_trains_only_the_adapters(ray_cluster, tiny_model):
    batch, scored = make_scored_batch(tiny_model, seed=4)
    group = learners(tiny_model, lora=LoraConfig(rank=4, alpha=8, target_modules=["c_attn"]))
    try:
        trainable = group.describe()["trainable"]
        before = group.policy_state()
        group.update(batch, scored, step=0)
        after = group.policy_state()  # adapters merged in
    finally:
        group.shutdown()
    assert trainable and all("lora_" in n for n in trainable)
    assert changed(before, after) and all("c_attn.weight" in k for k in changed(before, after))
    assert set(before) == set(AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()) - {"lm_head.weight"}


@pytest.mark.parametrize("optimizer", list(OptimizerKind))  # every stage: tests/unit/learner/test_nonfinite_steps.py
def test_a_nan_batch_is_skipped_and_counted(ray_cluster, tiny_model, optimizer):
    batch, scored = make_scored_batch(tiny_model, seed=5)
    scored.rewards[3] = float("nan")
    group = learners(tiny_model, optimizer=optimizer)
    try:
        metrics = group.update(batch, scored, step=0)
        after = group.policy_state()
    finally:
        group.shutdown()
    assert metrics["learner/skipped_steps"] >= 1 and metrics["learner/nonfinite_losses"] >= 1
    assert metrics["learner/nonfinite/advantages"] == 1.0  # the cause, named for the run's stop message
    assert "learner/nonfinite/old_logprobs" not in metrics
    # the NaN stays in its own group (GRPO is per group), so only mini-batches holding it are skipped
    assert all(torch.isfinite(t).all() for t in after.values())


@pytest.mark.parametrize("precision", [Precision.autocast, Precision.master_weights])
def test_resume_is_bit_identical(ray_cluster, tiny_model, tmp_path, precision):
    """Float32 weights, or bf16 weights whose float32 masters the checkpoint keeps (DeepSpeed's state): the
    resumed update equals the uninterrupted one to the bit, the policy and the separate critic."""
    b1, s1 = make_scored_batch(tiny_model, seed=6)
    b2, s2 = make_scored_batch(tiny_model, seed=7)
    a = algo(estimator=Estimator.gae, kl_controller="adaptive", target_kl=0.01, kl_horizon=100)
    kw = dict(value_head=ValueHead.separate, precision=precision)
    kw |= {"dtype": Dtype.bfloat16} if precision == Precision.master_weights else {}
    first = learners(tiny_model, a=a, **kw)
    try:
        first.update(b1, s1, step=0)
        first.update_kl(0.5, 16)
        saved = first.save(tmp_path / "ckpt")
        after_save = first.policy_state()
        want = first.update(b2, s2, step=1)
        want_state = first.policy_state()
    finally:
        first.shutdown()
    second = learners(tiny_model, a=a, **kw)
    try:
        second.load(saved)
        got = second.update(b2, s2, step=1)
        got_state = second.policy_state()
    finally:
        second.shutdown()
    assert not changed(want_state, got_state)
    assert {k: v for k, v in got.items() if k != "learner/tokens_per_s"} == {
        k: v for k, v in want.items() if k != "learner/tokens_per_s"
    }
    assert got["kl/coef"] != 0.01  # the adaptive coefficient came back from the checkpoint
    # the checkpoint's policy is a plain Hugging Face folder with the weights at save time
    hf = AutoModelForCausalLM.from_pretrained(saved / "policy").state_dict()
    assert all(torch.equal(hf[k], after_save[k]) for k in after_save)
    assert not (tmp_path / "ckpt.tmp").exists()


def test_the_single_pass_update_equals_the_recompute_forward(ray_cluster, tiny_model):
    """One epoch of one mini-batch: the update's forward supplies the old logprobs (the recompute
    forward is skipped, experience.single_pass). Metrics (top-k on, so the filtered gap is filled
    too) and the weights after the step equal those of the two-forward update."""
    from learner.experience import single_pass

    batch, scored = make_scored_batch(tiny_model, seed=3)
    a = algo(mini_batch_size=len(batch), micro_batch_size=4)
    assert single_pass(a, len(batch))
    runs = []
    for fused in (True, False):
        group = LearnerGroup(
            LearnerConfig(model_path=tiny_model, lr=1e-3),
            a,
            SamplerSettings(n_samples_per_prompt=GROUP, top_k=20),
            1,
            seed=0,
            placement=RankPlacement(num_cpus=0, threads=1),
        )
        try:
            group.ranks[0].__ray_call__.remote(lambda self, f=fused: setattr(self, "single_pass", f))
            runs.append((group.update(batch, scored, step=0), group.policy_state()))
        finally:
            group.shutdown()
    (m1, w1), (m0, w0) = runs
    for key in (
        "loss/policy",
        "loss/kl",
        "kl/ref",
        "kl/ref_seq",
        "rollout/logprob_gap",
        "rollout/outside_filter_frac",
        "learner/grad_norm",
        "learner/approx_kl",
    ):
        assert m1[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-7), key
    assert m1["rollout/outside_filter_frac"] > 0  # the filter did exclude tokens
    # Adam's first step is lr * g / (|g| + eps): a gradient entry near eps turns float rounding of the
    # two paths' forwards into a visible share of one step, so allow 2% of lr there and 1e-6 elsewhere
    diff = torch.cat([(w1[k] - w0[k]).abs().flatten() for k in w0])
    assert diff.max() < 0.02 * 1e-3 and (diff > 1e-6).float().mean() < 1e-3, (diff.max(), (diff > 1e-6).sum())


def test_a_single_pass_update_over_two_ranks_equals_the_recompute_one(ray_cluster, tiny_model, zero_batch):
    """Over two ranks the single-pass old logprobs are filled by each rank for its own rows and
    assembled with an all-reduce: metrics and weights match the two-rank update that recomputes them
    (measured: 2.8e-6 apart; one rank against two differs by 2.7e-5 either way, Adam's first step
    amplifying rounding)."""
    a = algo(mini_batch_size=len(zero_batch[0]), micro_batch_size=4)
    results = []
    for fused in (True, False):
        group = learners(tiny_model, world=2, a=a)
        try:
            ray.get([r.__ray_call__.remote(lambda self, f=fused: setattr(self, "single_pass", f)) for r in group.ranks])
            results.append((group.update(*zero_batch, step=0), group.policy_state()))
        finally:
            group.shutdown()
    (m1, w1), (m0, w0) = results
    for key in ("kl/ref", "kl/ref_seq", "rollout/logprob_gap", "loss/policy", "loss/kl"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-6), key
    # the behaviour logprobs are -1.0 placeholders: an unfilled (zero) old logprob would make the gap exactly 1
    assert abs(m1["rollout/logprob_gap"] - 1.0) > 1e-3
    worst = max(float((w1[k] - w0[k]).abs().max()) for k in w0)
    assert worst < 1e-5, f"max |param difference| {worst:.2e}"
