"""Trainer.train_step's KL controller input and staleness histogram (review B, items 2 and 9), with
its phases as stubs: the adaptive controller is told the samples that trained, not the batch's rows,
and an endpoint batch's histogram covers its own bound (rollout.endpoint.max_staleness)."""

from contextlib import nullcontext
from types import SimpleNamespace

from orchestrator.trainer import Trainer
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch


def loop(valid: list[bool], versions: list[int], step: int, gateway):
    n = len(valid)
    batch = RolloutBatch(
        list(range(n)), [[1]] * n, [[2]] * n, [[0.0]] * n, ["x"] * n, ["stop"] * n, version_first=versions
    )
    scored = ScoredBatch([1.0] * n, {}, valid, [not v for v in valid], [[0.0]] * n, raw=[1.0] * n)
    stats = {"kl/ref_seq": 2.0, "learner/skipped_steps": 0.0, "learner/nonfinite_losses": 0.0}
    calls = []
    return calls, SimpleNamespace(
        cfg=SimpleNamespace(data=SimpleNamespace(dynamic_sampling=False), logging=SimpleNamespace(profile_step=0)),
        step=step,
        counters={},
        sleep_engines=False,
        lead=0,
        gateway=gateway,
        endpoint=SimpleNamespace(max_staleness=2),
        next_batch=lambda: (batch, [{}] * n, None),
        score=lambda b, e, judged: scored,
        _judge_next=lambda: None,
        _busy=lambda: {"rollout": [0.0], "scoring": [0.0]},
        rollout=SimpleNamespace(asleep=lambda on: nullcontext()),
        scoring=SimpleNamespace(restarts=0),
        check_progress=lambda s, sc: None,
        push=lambda version: None,
        learner=SimpleNamespace(
            update=lambda b, s, step: stats, update_kl=lambda kl, samples: calls.append((kl, samples)) or 0.01
        ),
    )


def test_the_kl_controller_counts_only_the_samples_that_trained():
    calls, t = loop([True, False, False, True], [0] * 4, 0, None)
    Trainer.train_step(t)
    assert calls == [(2.0, 2)]  # 2 of 4 samples trained: the horizon's step is 2, not 4


def test_an_endpoint_batchs_staleness_histogram_covers_the_endpoints_bound():
    _, t = loop([True] * 4, [5, 4, 3, 5], 5, gateway=object())
    m = Trainer.train_step(t)
    assert (m["async/staleness_0"], m["async/staleness_1"], m["async/staleness_2"]) == (0.5, 0.25, 0.25)
    _, t = loop([True] * 4, [5] * 4, 5, gateway=None)  # prompts in sync mode: lead 0, one bucket
    assert "async/staleness_1" not in Trainer.train_step(t)
