"""The learner trains exactly the batch it is given, whatever its size: each mini-batch is one
optimizer step on the gradient of that mini-batch's own loss, even a short last one (33 rows with
mini_batch_size 32, as an endpoint batch of whole episodes could be), and nothing carries over to
the next update. A real DeepSpeed engine (ZeRO 0, gloo, one rank) in this process."""

import math

import pytest
import torch

from learner import algorithms as A
from learner.config import AlgorithmConfig, Estimator, LearnerConfig
from learner.engine import RankAddress
from learner.micro_batch_loss import LossSettings, loss_norm_tokens, policy_loss
from learner.worker import Learner
from runtime.logprobs import SamplerSettings
from runtime.ports import free_port
from tests.helpers import make_scored_batch

GROUP = 3


@pytest.fixture(scope="module")
def learner(tiny_model):
    algo = AlgorithmConfig(
        estimator=Estimator.grpo, mini_batch_size=32, micro_batch_size=8, ppo_epochs=1, init_kl_coef=0.01
    )
    return Learner(
        LearnerConfig(model_path=tiny_model, lr=1e-3),
        algo,
        SamplerSettings(n_samples_per_prompt=GROUP),
        seed=0,
        address=RankAddress(0, 1, "127.0.0.1", free_port(), threads=1),
    )


def reference_grads(learner: Learner, exp, rows: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of the mini-batch's loss in one pass over all its rows, at the current weights
    (the weights' own gradients are put back afterwards)."""
    params = [p for p in learner.policy.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    a = learner.algo
    agg = a.loss_aggregation.value
    mb = exp.rows(rows)
    with torch.enable_grad():
        logits, _ = learner.policy(mb.input_ids, mb.attention_mask, mb.position_ids)
        loss, _ = policy_loss(
            logits,
            mb,
            a,
            learner.kl_ctl.value,
            LossSettings(
                learner.temperature,
                learner.cfg.logprob_chunk_tokens,
                max(A.aggregate_total(exp.mask[rows], agg), 1e-8),
                agg,
                norm_tokens=loss_norm_tokens(a, learner.sampling),
            ),
        )
        loss.backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    for p, g in zip(params, saved):
        p.grad = g
    return grads


def test_a_short_last_mini_batch_is_its_own_step_and_leaks_nothing(learner, tiny_model):
    batch, scored = make_scored_batch(tiny_model, n_prompts=11, group=GROUP, seed=8)  # 33 rows: mini-batches 32 + 1
    assert learner.algo.loss_aggregation.value == "token_mean"
    params = [p for p in learner.policy.parameters() if p.requires_grad]
    minis, steps = [], []
    train_mini = learner._train_mini_batch

    def record_mini(exp, rows, sums, one_pass):
        minis.append((exp, rows.clone()))
        return train_mini(exp, rows, sums, one_pass)

    inner = getattr(learner.policy_engine.optimizer, "optimizer", learner.policy_engine.optimizer)
    step = inner.step

    def record_step(closure=None):
        exp, rows = minis[-1]
        steps.append((len(rows), [p.grad.clone() for p in params], reference_grads(learner, exp, rows)))
        return step(closure)

    learner._train_mini_batch, inner.step = record_mini, record_step
    try:
        metrics = learner.update(batch, scored, step=0)
    finally:
        learner._train_mini_batch, inner.step = train_mini, step
    assert [n for n, _, _ in steps] == [32, 1]  # one optimizer step per mini-batch, the 1-row one included
    for _, got, want in steps:
        scale = max(float(w.abs().max()) for w in want)
        worst = max(float((g - w).abs().max()) for g, w in zip(got, want))
        assert scale > 0 and worst < 1e-5 * scale, f"max |grad difference| {worst:.2e} of {scale:.2e}"
    assert all(p.grad is None or not p.grad.any() for p in params)  # nothing left for the next update
    assert metrics["learner/skipped_steps"] == 0


def test_grad_norm_is_the_mean_over_the_updates_optimizer_steps(learner, tiny_model):
    batch, scored = make_scored_batch(tiny_model, n_prompts=11, group=GROUP, seed=9)
    inner = getattr(learner.policy_engine.optimizer, "optimizer", learner.policy_engine.optimizer)
    step, norms = inner.step, []

    def record_step(closure=None):
        out = step(closure)
        norms.append(inner._global_grad_norm)  # the pre-clip norm GuardedAdamW measured for this step
        return out

    inner.step = record_step
    try:
        metrics = learner.update(batch, scored, step=1)
    finally:
        inner.step = step
    # two different steps: the last alone is not the mean
    assert len(norms) == 2 and norms[0] != pytest.approx(norms[1])
    assert metrics["learner/grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-6)


def test_a_batch_with_no_trainable_sample_takes_no_step_and_moves_no_weight(learner, tiny_model):
    """Every sample dropped as could-not-judge (reward.invalid: drop): a zero gradient step would still
    move the weights through Adam's momentum from the update before and through weight decay."""
    import dataclasses

    batch, scored = make_scored_batch(tiny_model, n_prompts=4, group=GROUP, seed=10)
    learner.update(batch, scored, step=2)  # momentum to carry
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    dropped = dataclasses.replace(scored, valid=[False] * len(batch), invalid=[True] * len(batch))
    metrics = learner.update(batch, dropped, step=3)
    assert all(torch.equal(before[k], v) for k, v in learner.policy.state_dict().items())
    assert metrics["learner/skipped_steps"] == 0
    # no token trained: no KL to report (not 0, which would shrink an adaptive coefficient)
    assert math.isnan(metrics["kl/ref"]) and math.isnan(metrics["kl/ref_seq"])


def test_per_token_metrics_weigh_every_token_of_the_update_not_each_mini_batch_alike(learner, tiny_model, monkeypatch):
    """33 rows in mini-batches of 32 + 1: learner/entropy and approx_kl are means over all the update's
    response tokens (an unweighted mean over mini-batches gives the 1-row one half the weight)."""
    import learner.worker as worker

    batch, scored = make_scored_batch(tiny_model, n_prompts=11, group=GROUP, seed=11)
    seen, forward = [], worker.policy_loss

    def record(logits, mb, *args, **kwargs):
        loss, terms = forward(logits, mb, *args, **kwargs)
        seen.append((float(mb.mask.sum()), float(terms["entropy_token"]), float(terms["approx_kl"])))
        return loss, terms

    monkeypatch.setattr(worker, "policy_loss", record)
    metrics = learner.update(batch, scored, step=4)
    tokens = sum(n for n, _, _ in seen)
    for k, name in ((1, "learner/entropy"), (2, "learner/approx_kl")):
        want = sum(row[0] * row[k] for row in seen) / tokens
        assert metrics[name] == pytest.approx(want, rel=1e-6), name
    last = seen[-1]  # the 1-row mini-batch: alone in the last micro-batch
    by_mini = (sum(n * e for n, e, _ in seen[:-1]) / sum(n for n, _, _ in seen[:-1]) + last[1]) / 2
    assert abs(by_mini - metrics["learner/entropy"]) > 1e-4  # the example tells the two apart


def test_grad_norm_is_nan_when_the_engine_reports_none(learner, tiny_model, monkeypatch):
    """An engine that returns None for the global norm (an optimizer that records none): unknown, not 0.0."""
    batch, scored = make_scored_batch(tiny_model, n_prompts=4, group=GROUP, seed=12)
    monkeypatch.setattr(learner.policy_engine, "get_global_grad_norm", lambda: None)
    assert math.isnan(learner.update(batch, scored, step=5)["learner/grad_norm"])
