"""Micro-batches of similar lengths, each cut to its own longest row (Experience.by_length, .rows):
the same loss, gradients and recomputed logprobs as full-width micro-batches in batch order."""

import torch
from transformers import AutoModelForCausalLM

from learner.config import AlgorithmConfig
from learner.experience import ForwardSettings, MicroBatch, make_experience
from learner.micro_batch_loss import LossSettings, policy_loss
from learner.models import PolicyValue
from runtime.logprobs import SamplerSettings, chunked_logprobs
from tests.helpers import make_scored_batch

MICRO = 4


def setup(tiny_model):
    batch, scored = make_scored_batch(tiny_model, n_prompts=4, group=4, seed=4)  # ragged prompts and responses
    policy = PolicyValue(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), False)
    cfg = AlgorithmConfig(init_kl_coef=0.05)
    exp = make_experience(
        policy, None, batch, scored, cfg, 0.05, ForwardSettings(SamplerSettings(n_samples_per_prompt=4), 0, MICRO, 0, 1)
    )
    return policy, cfg, exp


def test_recomputed_logprobs_do_not_depend_on_the_length_order(tiny_model):
    policy, _, exp = setup(tiny_model)
    with torch.no_grad():
        logits, _ = policy(exp.input_ids, exp.attention_mask, exp.position_ids)  # all rows at full width, in order
    whole = chunked_logprobs(logits, exp.input_ids[:, 1:]) * exp.mask  # every sample valid: mask = response tokens
    assert torch.allclose(exp.old_logprobs, whole, atol=1e-5)


def test_bucketed_trimmed_micro_batches_give_the_padded_loss_and_gradients(tiny_model):
    policy, cfg, exp = setup(tiny_model)
    n, total = len(exp.input_ids), float(exp.mask.sum())

    def run(micro_batches):
        policy.zero_grad()
        loss = 0.0
        for mb in micro_batches:
            logits, _ = policy(mb.input_ids, mb.attention_mask, mb.position_ids)
            part, _ = policy_loss(logits, mb, cfg, 0.05, LossSettings(1.0, 16, total, "token_mean"))
            part.backward()
            loss += float(part)
        return loss, [p.grad.clone() for p in policy.parameters()]

    full = [
        MicroBatch(**{k: v[i : i + MICRO] if isinstance(v, torch.Tensor) else v for k, v in vars(exp).items()})
        for i in range(0, n, MICRO)
    ]
    order = exp.by_length(torch.arange(n))
    bucketed = [exp.rows(order[i : i + MICRO]) for i in range(0, n, MICRO)]
    widths = [mb.input_ids.shape[1] for mb in bucketed]
    assert widths == sorted(widths, reverse=True) and widths[-1] < exp.input_ids.shape[1]  # padding was cut
    (loss0, grads0), (loss1, grads1) = run(full), run(bucketed)
    assert abs(loss0 - loss1) < 1e-6
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads0, grads1))
