"""Shared fixtures: a tiny real model on disk and one local Ray cluster per test session."""

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A randomly initialised 2-layer GPT-2 with a character tokenizer (HF folder, ~1.7 MB)."""
    from learner.tiny_gpt import init_tiny_gpt

    return str(init_tiny_gpt(tmp_path_factory.mktemp("models") / "tiny-gpt", seed=0))


@pytest.fixture(scope="session")
def policy(tmp_path_factory):
    """relay's tiny starting policy: a GPT trained from scratch on 2-digit addition to ~50-75%."""
    from orchestrator.builtin_models import build_tiny_policy

    return str(build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny"))


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(
        num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "0"}}
    )
    yield ray
    ray.shutdown()


def make_scored_batch(model_path, n_prompts=4, group=4, seed=0, rewards=None):
    """A RolloutBatch of random prompts/responses (ragged) and its ScoredBatch with real reference
    logprobs; rewards random unless given."""
    import torch

    from reward_service.reference import ReferenceModel
    from reward_service.types import ScoredBatch
    from rollout.types import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(n_prompts):
        p = torch.randint(3, 60, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        for _ in range(group):
            prompts.append(p)
            responses.append(torch.randint(3, 60, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist())
    n = len(prompts)
    batch = RolloutBatch(
        [i // group for i in range(n)],
        prompts,
        responses,
        [[-1.0] * len(r) for r in responses],
        ["x"] * n,
        ["stop"] * n,
    )
    scores = rewards if rewards is not None else torch.rand(n, generator=g).tolist()
    return batch, ScoredBatch(
        scores, {}, [True] * n, [False] * n, ReferenceModel(model_path).logprobs(batch), raw=list(scores)
    )


def make_micro_batch(input_ids, mask, **tensors):
    """A learner.experience.MicroBatch for a loss test from `tensors` (by field name): attention_mask
    all ones, positions 0.., no critic, and NaN in each other (B, L-1) field it is not given, so a loss
    that reads a field the test did not give comes out NaN instead of passing on made-up numbers."""
    import torch

    from learner.experience import MicroBatch

    nan = torch.full(mask.shape, float("nan"))
    fields = dict.fromkeys(("old_logprobs", "ref_logprobs", "behaviour_logprobs", "sampler_logprobs", "advantages"))
    fields = {k: nan.clone() for k in fields} | {"old_values": None, "returns": None} | tensors
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    return MicroBatch(input_ids, torch.ones_like(input_ids), positions, mask, **fields)
