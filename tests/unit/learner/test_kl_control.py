"""The KL coefficient controllers against hand-computed updates, and their state across a resume."""

import torch

from learner import algorithms as A
from learner.kl_control import AdaptiveKLController, FixedKLController
from tests.helpers import close

t = torch.tensor


def test_fixed_controller_never_moves():
    c = FixedKLController(0.05)
    c.update(100.0, 1000)
    assert c.value == 0.05 and c.state_dict() == {"value": 0.05}


def test_adaptive_controller_hand_example():
    # KL 9 vs target 6: error .5 clipped to .2; x(1 + .2 * 256/10000) = x1.00512 -> .201024
    c = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    c.update(9.0, 256)
    assert close(c.value, 0.201024, tol=1e-9)
    # KL 3 vs 6: error -.5 -> -.2; x(1 - .2 * 256/10000) = x0.99488
    c.update(3.0, 256)
    assert close(c.value, 0.201024 * 0.99488, tol=1e-9)
    # small error is proportional: KL 6.6 -> error .1 -> x1.00256
    c2 = AdaptiveKLController(0.1, 6.0, 10000)
    c2.update(6.6, 256)
    assert close(c2.value, 0.100256, tol=1e-9)


def test_a_batch_with_a_known_kl_moves_the_adaptive_coefficient_by_the_formula():
    # per-sequence KL (6 + 1) / 2 = 3.5 against a target of 3: error 3.5/3 - 1 = .16667 (within the
    # +-.2 clip), 2 samples over a horizon of 10 -> x(1 + .16667 * 2 / 10) = x1.033333
    kl = t([[1.0, 2.0, 3.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    mask = t([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    c = AdaptiveKLController(0.1, target=3.0, horizon=10)
    c.update(float(A.sequence_kl(kl, mask)), 2)
    assert close(c.value, 0.1 * (1 + (3.5 / 3 - 1) * 2 / 10), tol=1e-9) and close(c.value, 0.1033333, tol=1e-7)
    # fed the per-token mean (1.4) instead, the same batch would have *lowered* it (error clipped to -.2)
    wrong = AdaptiveKLController(0.1, target=3.0, horizon=10)
    wrong.update(float(A.masked_mean(kl, mask)), 2)
    assert wrong.value < 0.1 < c.value


def test_adaptive_controller_state_survives_resume():
    c = AdaptiveKLController(0.1, target=1.0, horizon=100)
    for kl in (3.0, 2.0, 0.1, 5.0):
        c.update(kl, 10)
    resumed = AdaptiveKLController(0.1, target=1.0, horizon=100)
    resumed.load_state_dict(c.state_dict())
    assert resumed.value == c.value != 0.1
    c.update(2.0, 10), resumed.update(2.0, 10)
    assert resumed.value == c.value
    c.update(float("nan"), 10)
    assert resumed.value == c.value  # a NaN measurement leaves the coefficient alone
