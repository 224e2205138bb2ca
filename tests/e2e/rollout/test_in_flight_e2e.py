"""Weights taken in flight on a real AsyncLLM engine: running sequences pause (vLLM's keep), continue
under the new weights, and every token carries the version that sampled it.

The sentinel: version 1 zeroes GPT-2's final layer norm, so its logits are all 0 and every token it
samples has logprob exactly -log(V); versions 0 and 2 (the random model) never do. A token's version
label is then checked against the weights that really sampled it, token by token."""

import math
import time

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from rollout.config import RolloutConfig, SamplingConfig
from rollout.pool import RolloutPool

pytestmark = pytest.mark.e2e
PROMPTS = ["12+34=", "7*8=", "hello", "abc"] * 4


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_model):
    cfg = RolloutConfig(
        max_model_len=128, max_prompt_tokens=16, sampling=SamplingConfig(max_new_tokens=110, n_samples_per_prompt=4)
    )
    pool = RolloutPool(cfg, tiny_model, num_workers=1, seed=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    original = {n: t.detach().clone() for n, t in model.state_dict().items()}
    flat = dict(original)
    flat["transformer.ln_f.weight"] = torch.zeros_like(flat["transformer.ln_f.weight"])
    flat["transformer.ln_f.bias"] = torch.zeros_like(flat["transformer.ln_f.bias"])
    yield pool, ray.put(list(original.items())), ray.put(list(flat.items())), model.config.vocab_size
    pool.shutdown()


def reached(worker, pending: list, tokens: int) -> int:
    """Wait until the call `pending` has its sequences in the worker's engine and each unfinished one
    has sampled `tokens`; returns the most any has sampled. Bounded by the call: once it has returned
    there is nothing to wait for (the test's assertions then tell)."""
    while not all(ray.wait([ref], timeout=0)[0] for ref in pending):
        counts = ray.get(worker.sampled_so_far.remote())
        if counts and min(counts) >= tokens:
            return max(counts)
        time.sleep(0.01)
    return 0


def test_running_sequences_take_new_weights_and_tag_each_token(engine):
    """The updates land at set points of the sequences (after each has sampled 4 tokens, then 4 more
    than any had at the first update), not at set times, so the test does not depend on the load."""
    pool, original, flat, vocab = engine
    worker = pool.workers[0]
    pool.generate(PROMPTS, step=0)  # warm
    pending = pool.submit(PROMPTS, step=1)
    first = reached(worker, pending, 4)
    assert ray.get(worker.load_weights.remote(flat, 1, True, pool.sync_order()[0])) > 0
    reached(worker, pending, first + 4)
    ray.get(worker.load_weights.remote(original, 2, True, pool.sync_order()[0]))
    batch = pool.collect(pending)
    uniform = -math.log(vocab)
    spanned = 0
    for versions, lps in zip(batch.token_versions, batch.logprobs):
        assert len(versions) == len(lps) and versions == sorted(versions) and set(versions) <= {0, 1, 2}
        for v, lp in zip(versions, lps):
            assert (abs(lp - uniform) < 1e-5) == (v == 1), (v, lp)  # the label is the weights that sampled it
        spanned += set(versions) == {0, 1, 2}
    assert spanned > 0  # some sequences ran through both updates
    assert batch.version_first == [v[0] for v in batch.token_versions]
    assert batch.version_last == [v[-1] for v in batch.token_versions]
    after = pool.generate(PROMPTS, step=2)  # started after the last update: all of it version 2
    assert all(set(v) == {2} for v in after.token_versions)


@pytest.mark.parametrize("repeat", range(3))
def test_weights_between_calls_follow_the_calls_sent_before_and_precede_those_after(engine, repeat):
    """Ray runs an async actor's calls out of order (the weights' object-store argument makes the sync
    arrive later than the call after it here): the pool's numbering keeps the order it sent them in."""
    pool, original, flat, vocab = engine
    worker = pool.workers[0]
    ray.get(worker.load_weights.remote(original, 3, False, pool.sync_order()[0]))
    pending = pool.submit(PROMPTS, step=3)
    update = worker.load_weights.remote(flat, 4, False, pool.sync_order()[0])  # after the call before it
    later = pool.submit(PROMPTS, step=4)  # before the call after it
    batch = pool.collect(pending)
    ray.get(update)
    assert all(set(v) == {3} for v in batch.token_versions)
    assert all(set(v) == {4} for v in pool.collect(later).token_versions)
