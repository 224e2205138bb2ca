"""learner.dtype bfloat16: autocast over float32 master weights (runtime.device.compute). The
policy's logprobs stay within a stated tolerance of float32's, the reference computes exactly the
policy's function (KL 0 at step 0), the forward really runs its matmuls in bf16, and the weights,
gradients and optimizer stay float32."""

import torch
from transformers import AutoModelForCausalLM

from learner.config import Dtype, LearnerConfig
from learner.experience import ragged_to_dense
from learner.models import PolicyValue, build_policy
from reward_service.reference import ReferenceModel
from rollout.types import pack
from runtime.forward import PolicyFunction
from runtime.logprobs import chunked_logprobs
from tests.helpers import make_scored_batch

# bf16 keeps 8 bits of mantissa; on the random tiny GPT the gap was mean 8e-4, max 2.7e-3 nats
# (relay's trained tiny policy: mean 0.016, max 0.11; see docs/benchmarks.md for SmolLM2)
MEAN_TOL, MAX_TOL = 5e-3, 2e-2


def logprobs(model, batch, dtype):
    ids, attention, positions, mask = pack(batch.prompt_ids, batch.response_ids, 0)
    with torch.no_grad():
        logits, _ = PolicyValue(model, False, dtype)(ids, attention, positions)
    return chunked_logprobs(logits, ids[:, 1:], 1.0) * mask, mask, logits.dtype


def test_bf16_logprobs_are_within_tolerance_of_float32_and_the_reference_is_the_same_function(tiny_model):
    batch, _ = make_scored_batch(tiny_model, n_prompts=4, group=4, seed=1)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    fp32, mask, fp32_logits = logprobs(lm, batch, Dtype.float32)
    bf16, _, bf16_logits = logprobs(lm, batch, Dtype.bfloat16)
    assert fp32_logits == torch.float32 and bf16_logits == torch.bfloat16  # the matmuls did run in bf16
    gap = (fp32 - bf16).abs()[mask > 0]
    assert 0 < gap.mean() < MEAN_TOL and gap.max() < MAX_TOL
    ref = ragged_to_dense(ReferenceModel(tiny_model, PolicyFunction("bfloat16")).logprobs(batch), mask)
    assert torch.equal(ref, bf16)  # reference and policy: the same numbers, so the KL starts at exactly 0


def test_bf16_keeps_float32_weights_and_gradients(tiny_model):
    policy = build_policy(LearnerConfig(model_path=tiny_model, dtype=Dtype.bfloat16), value_head=True)
    batch, _ = make_scored_batch(tiny_model, n_prompts=2, group=2, seed=2)
    ids, attention, positions, mask = pack(batch.prompt_ids, batch.response_ids, 0)
    logits, values = policy(ids, attention, positions)
    (chunked_logprobs(logits, ids[:, 1:]) * mask).sum().add((values * mask).sum()).backward()
    params = list(policy.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params if p.requires_grad)
