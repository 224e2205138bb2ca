"""The math core drives REINFORCE-with-baseline on CartPole: a task with a known answer."""

import sys

import pytest

from tests.helpers import REPO

pytest.importorskip("gymnasium")
sys.path.insert(0, str(REPO / "examples"))

from cartpole_reinforce import train  # noqa: E402


def test_cartpole_moving_average_clearly_rises():
    import torch

    torch.set_num_threads(1)
    history = train(episodes=240, seed=0)  # ~12 s; the full example reaches 475 in ~430 episodes
    assert history[0] < 60  # a random policy balances ~20-40 steps
    assert history[-1] > 150, history[-10:]
