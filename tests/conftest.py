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
def ray_cluster():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "0"}})
    yield ray
    ray.shutdown()
