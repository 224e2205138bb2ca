"""Fixtures of the learner's unit tests."""

import os

import pytest

from learner.engine import RankAddress, init_distributed
from learner.tiny_gpt import init_tiny_llama
from runtime.ports import free_port


@pytest.fixture(scope="module")
def one_rank():
    """One gloo rank in this process, for real DeepSpeed engines (make_engine)."""
    env = dict(os.environ)
    init_distributed(RankAddress(0, 1, "127.0.0.1", free_port(), threads=1), "gloo")
    yield
    # the group stays: DeepSpeed keeps references to it, and a later rank in this process reuses it
    os.environ.clear()
    os.environ.update(env)  # init_distributed set RANK, MASTER_PORT, ...: not for the tests after these


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama (RoPE, RMSNorm, q/k/v/o projections), where tiny_model is a GPT-2."""
    return str(init_tiny_llama(tmp_path_factory.mktemp("llama"), seed=3))
