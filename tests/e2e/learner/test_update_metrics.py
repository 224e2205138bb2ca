"""The learner's update metrics on a real DeepSpeed rank: per-token units under every loss aggregation,
and the off-policy ratio taken between like and like under a top-k filter."""

import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner import algorithms as A
from learner.config import AlgorithmConfig, LearnerConfig, LossAggregation, OffPolicyConfig, OffPolicyKind
from learner.group import LearnerGroup, RankPlacement
from learner.models import PolicyValue
from rollout.types import pack, unpad
from runtime.logprobs import SamplerSettings, chunked_logprobs_entropy, filtered_logprobs
from tests.helpers import make_scored_batch

pytestmark = pytest.mark.e2e
GROUP, TOP_K, REF_GAP = 4, 3, 0.3


def greedy_batch(model_path):
    """8 samples whose responses are the tiny model's greedy tokens (inside any top-k), of 2..6 tokens,
    with behaviour logprobs as vLLM reports them under top-k (the learner's, renormalised inside it)
    and a reference REF_GAP below the policy on every token; and their per-token entropy, computed here."""
    batch, scored = make_scored_batch(model_path, n_prompts=2, group=GROUP, seed=5)
    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    responses = []
    with torch.no_grad():
        for i, prompt in enumerate(batch.prompt_ids):
            ids = list(prompt)
            for _ in range(2 + i % 5):
                ids.append(int(lm(torch.tensor([ids])).logits[0, -1].argmax()))
            responses.append(ids[len(prompt) :])
    input_ids, attention, positions, mask = pack(batch.prompt_ids, responses, 0)
    with torch.no_grad():
        logits, _ = PolicyValue(lm, False)(input_ids, attention, positions)
    labels = input_ids[:, 1:]
    lp, entropy = chunked_logprobs_entropy(logits, labels)
    filtered = filtered_logprobs(logits, labels, top_k=TOP_K)
    batch = dataclasses.replace(batch, response_ids=responses, logprobs=unpad(filtered, mask))
    scored = dataclasses.replace(scored, ref_logprobs=unpad(lp - REF_GAP, mask))
    return batch, scored, float(A.masked_mean(entropy, mask))


@pytest.mark.parametrize("agg", [LossAggregation.seq_sum_norm, LossAggregation.seq_mean])
def test_entropy_and_kl_are_per_token_and_the_filtered_ratio_is_one_in_sync(ray_cluster, tiny_model, agg):
    batch, scored, entropy = greedy_batch(tiny_model)
    a = AlgorithmConfig(
        loss_aggregation=agg,
        loss_norm_tokens=16,
        mini_batch_size=8,
        micro_batch_size=4,
        init_kl_coef=0.01,
        off_policy=OffPolicyConfig(correction=OffPolicyKind.icepop),
    )
    group = LearnerGroup(
        LearnerConfig(model_path=tiny_model, lr=1e-3),
        a,
        SamplerSettings(n_samples_per_prompt=GROUP, top_k=TOP_K),
        1,
        seed=0,
        placement=RankPlacement(num_cpus=0, threads=1),
    )
    try:
        m = group.update(batch, scored, step=0)
    finally:
        group.shutdown()
    # two micro-batches forward on the initial weights (one optimizer step per mini-batch)
    assert m["learner/entropy"] == pytest.approx(entropy, rel=1e-4)
    assert m["loss/kl"] == pytest.approx(math.exp(-REF_GAP) - 1 + REF_GAP, rel=1e-3)  # k3 of a 0.3 log-ratio
    # behaviour = the learner's own under the same filter: nothing to correct, nothing masked
    assert m["off_policy/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["off_policy/clipped_frac"] == 0.0
