"""Chunked logprobs/entropy (runtime/logprobs.py) against the unchunked math core: the same numbers
and gradients, no float32 (B, T, V) tensor, the entropy out of the graph when unused; and
gradient checkpointing in the supervised learner's model."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from learner import algorithms as A
from learner.config import AlgorithmConfig, KLPlacement, LearnerConfig
from learner.micro_batch_loss import LossSettings, policy_loss
from learner.supervised import RM, SFT, build_model
from runtime.logprobs import (
    chunk_spans,
    chunked_logprobs,
    chunked_logprobs_entropy,
    entropy_from_logits,
    filtered_logprobs,
    logprobs_from_logits,
    map_chunks,
)
from tests.helpers import make_micro_batch

B, T, V, TEMP = 3, 7, 11, 0.7


def inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 2).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[1] = 0.0  # a padding row
    mask[2, 4:] = 0.0  # a right-padded row
    return logits, labels, mask


def unchunked(logits, labels, mask):
    x = logits.float() / TEMP
    return logprobs_from_logits(x, labels), entropy_from_logits(x, mask)


def test_chunk_spans_cover_every_token_once_within_the_budget():
    assert list(chunk_spans(4, 2, 5)) == [(slice(0, 2), slice(0, 2)), (slice(2, 4), slice(0, 2))]  # 2 rows of 2
    assert list(chunk_spans(2, 5, 3)) == [
        (slice(0, 1), slice(0, 3)),
        (slice(0, 1), slice(3, 6)),
        (slice(1, 2), slice(0, 3)),
        (slice(1, 2), slice(3, 6)),
    ]
    for b, t, c in [(3, 7, 1), (3, 7, 4), (3, 7, 7), (3, 7, 15), (5, 1, 2)]:
        seen = torch.zeros(b, t)
        for rows, pos in chunk_spans(b, t, c):
            assert seen[rows, pos].numel() <= c
            seen[rows, pos] += 1
        assert (seen == 1).all()
    with pytest.raises(ValueError, match="chunk_tokens"):
        list(chunk_spans(1, 1, 0))


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 8, 21, 1024])  # T = 7; 2, 3, 5 do not divide it
def test_chunked_equals_unchunked_in_float32_with_gradients(chunk):
    logits, labels, mask = inputs()
    lp0, ent0 = unchunked(logits, labels, mask)
    lp, ent = chunked_logprobs_entropy(logits, labels, TEMP, chunk, entropy_grad=True)
    torch.testing.assert_close(lp, lp0, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.where(mask > 0, ent, 0.0), ent0, atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked_logprobs(logits, labels, TEMP, chunk), lp0, atol=1e-6, rtol=0)
    w1, w2 = torch.randn(B, T), torch.randn(B, T)
    (g0,) = torch.autograd.grad((lp0 * w1 * mask).sum() + (ent0 * w2).sum(), logits)
    (g,) = torch.autograd.grad((lp * w1 * mask).sum() + (ent * w2 * mask).sum(), logits)
    torch.testing.assert_close(g, g0, atol=1e-6, rtol=0)
    assert (g[1] == 0).all()  # the padding row gets no gradient


@pytest.mark.parametrize("chunk", [2, 7, 64])
def test_chunked_equals_unchunked_within_bf16_rounding(chunk):
    logits, labels, mask = inputs(torch.bfloat16)
    lp0, ent0 = unchunked(logits, labels, mask)
    lp, ent = chunked_logprobs_entropy(logits, labels, TEMP, chunk, entropy_grad=True)
    assert lp.dtype == torch.float32  # computed in float32 from bf16 logits, like the unchunked path
    torch.testing.assert_close(lp, lp0, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.where(mask > 0, ent, 0.0), ent0, atol=1e-6, rtol=0)
    w = torch.randn(B, T)
    (g0,) = torch.autograd.grad((lp0 * w).sum() + (ent0 * w).sum(), logits)
    (g,) = torch.autograd.grad((lp * w).sum() + (ent * w * mask).sum(), logits)
    assert g.dtype == torch.bfloat16
    torch.testing.assert_close(g, g0)  # bf16 tolerances: one rounding of the same float32 gradient


def test_filtered_logprobs_by_chunks_equal_the_whole():
    logits, labels, _ = inputs()
    with torch.no_grad():
        whole = filtered_logprobs(logits / TEMP, labels, top_k=4, top_p=0.8)
    parts = map_chunks(lambda x, y: filtered_logprobs(x, y, 4, 0.8), logits, labels, TEMP, 3)
    assert torch.equal(parts, whole)  # -inf outside the kept set included


# ---------------------------------------------------------------- the learner's loss


def micro_batch(logits, labels, mask):
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.zeros(B, 1, dtype=torch.long), labels], 1)
    return make_micro_batch(
        ids,
        mask,
        old_logprobs=-torch.rand(B, T, generator=g) * 3,
        ref_logprobs=-torch.rand(B, T, generator=g) * 3,
        advantages=torch.randn(B, T, generator=g) * mask,
    )


def old_policy_loss(logits, mb, algo, kl_coef):
    """Learner._policy_loss as it was: float32 (B, T, V) logits, entropy always in the graph."""
    x, mask = logits.float() / TEMP, mb.mask
    lp = logprobs_from_logits(x, mb.input_ids[:, 1:])
    pg, _ = A.ppo_policy_loss(A.PolicyLossInput(lp, mb.old_logprobs, mb.advantages, mask), algo.clip_eps)
    loss = pg - algo.entropy_coef * A.aggregate(entropy_from_logits(x, mask), mask)
    kl = A.aggregate(A.kl_penalty(lp, mb.ref_logprobs, algo.kl_estimator.value, mask), mask)
    return loss + kl_coef * kl


def new_policy_loss(logits, mb, algo, kl_coef, chunk=3):
    total = A.aggregate_total(mb.mask, "token_mean")
    return policy_loss(logits, mb, algo, kl_coef, LossSettings(TEMP, chunk, total, "token_mean"))


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_policy_loss_equals_the_unchunked_one_and_keeps_the_entropy_out_of_the_graph_when_unused(entropy_coef):
    logits, labels, mask = inputs()
    mb = micro_batch(logits, labels, mask)
    algo = AlgorithmConfig(entropy_coef=entropy_coef, kl_placement=KLPlacement.loss)
    loss, terms = new_policy_loss(logits, mb, algo, 0.1)
    want = old_policy_loss(logits, mb, algo, 0.1)
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        torch.autograd.grad(loss, logits)[0], torch.autograd.grad(want, logits)[0], atol=1e-6, rtol=0
    )
    assert loss.grad_fn is not None and set(terms) == {
        "policy",
        "entropy",
        "clip_frac",
        "approx_kl",
        "kl",
        "logprobs",
        "entropy_token",
        "kl_token",
        "sampler_logprobs",
    }
    assert terms["logprobs"].grad_fn is None  # detached: the old logprobs of a single pass (experience.single_pass)
    assert (terms["entropy"].grad_fn is None) == (entropy_coef == 0)  # still reported, as a metric
    assert terms["entropy"].item() > 0


class LargestFloat32(TorchDispatchMode):
    """Records the largest float32 tensor any (non-view) op creates, forward and backward."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for x in tree_flatten(out)[0]:
                if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
                    self.largest = max(self.largest, x.numel())
        return out


def test_no_float32_logits_sized_tensor_in_the_loss_forward_or_backward():
    logits, labels, mask = inputs(torch.bfloat16)
    mb, algo = micro_batch(logits, labels, mask), AlgorithmConfig(entropy_coef=0.05, kl_placement=KLPlacement.loss)
    chunk = 3
    with LargestFloat32() as probe:
        new_policy_loss(logits, mb, algo, 0.1, chunk)[0].backward()
    assert logits.grad is not None and probe.largest <= chunk * V, (probe.largest, chunk * V)
    logits.grad = None
    with LargestFloat32() as old:  # the probe sees the unchunked path's (B, T, V) float32 copy
        old_policy_loss(logits, mb, algo, 0.1).backward()
    assert old.largest >= B * T * V


# ---------------------------------------------------------------- supervised learner


@pytest.mark.parametrize("kind", [SFT, RM])
def test_supervised_model_honours_gradient_checkpointing(tiny_model, kind):
    on = build_model(LearnerConfig(model_path=tiny_model, gradient_checkpointing=True), kind, 0)
    off = build_model(LearnerConfig(model_path=tiny_model), kind, 0)
    assert on.is_gradient_checkpointing and not off.is_gradient_checkpointing


def test_old_logprobs_from_the_update_forward_give_the_same_loss_and_gradients():
    """experience.single_pass: with one optimizer step, the old logprobs a separate no-grad forward
    computes equal the update forward's own, detached; the loss and its gradients are the same."""
    cfg = AlgorithmConfig(kl_placement=KLPlacement.loss, init_kl_coef=0.05, entropy_coef=0.01)
    results = []
    for fused in (False, True):
        logits, labels, mask = inputs()
        g = torch.Generator().manual_seed(1)
        ids = torch.cat([torch.zeros(B, 1, dtype=torch.long), labels], 1)
        with torch.no_grad():
            old = chunked_logprobs(logits, labels, TEMP, 4)
        mb = make_micro_batch(
            ids,
            mask,
            old_logprobs=old,
            advantages=torch.randn(B, T, generator=g),
            ref_logprobs=old + 0.1 * torch.randn(B, T, generator=g),
        )
        loss, terms = policy_loss(
            logits, mb, cfg, 0.05, LossSettings(TEMP, 4, float(mask.sum()), "token_mean", old_from_forward=fused)
        )
        loss.backward()
        results.append((loss.detach(), logits.grad, terms["logprobs"]))
    (loss0, grad0, lp0), (loss1, grad1, lp1) = results
    assert torch.equal(lp0, lp1)
    assert torch.allclose(loss0, loss1, atol=1e-7) and torch.allclose(grad0, grad1, atol=1e-7)
    assert grad1.abs().sum() > 0
