"""Trainer.train_step's KL controller input and staleness histogram (review B, items 2 and 9), through
the real loop on stand-in roles: the adaptive controller is told the samples that trained, not the
batch's rows, and an endpoint batch's histogram covers its own bound (rollout.endpoint.max_staleness)."""

from orchestrator.loop import batches as batches_module
from rollout.types import RolloutBatch
from tests.small_loop import STATS, samples, scores, small_trainer


def test_the_kl_controller_counts_only_the_samples_that_trained(tmp_path):
    judge = lambda batch, k: scores([1.0] * 4, valid=[True, False, False, True])  # noqa: E731
    trainer, calls = small_trainer(tmp_path, judge=judge, stats=STATS | {"kl/ref_seq": 2.0})
    trainer.run(on_step=lambda step, metrics: True)
    assert [c for c in calls if c[0] == "update_kl"] == [("update_kl", 2.0, 2)]  # 2 of 4 trained: not 4


def test_an_endpoint_batchs_staleness_histogram_covers_the_endpoints_bound(tmp_path, monkeypatch):
    def finished_episodes(gateway, n, timeout_s, step) -> tuple[RolloutBatch, list[dict], dict]:
        batch = samples(n, 1, step)
        batch.version_first = [step, step - 1, step - 2, step]  # 0, 1 and 2 versions behind
        return batch, [{"prompt": "", "answer": "", "metadata": {}}] * n, {"endpoint/episodes": float(n)}

    monkeypatch.setattr(batches_module, "endpoint_batch", finished_episodes)
    over = ("data.rollout_batch_size=4", "rollout.endpoint.max_staleness=2")
    trainer, _ = small_trainer(tmp_path / "endpoint", *over, gateway="gateway")
    rows = []
    trainer.run(on_step=lambda step, metrics: rows.append(metrics))
    m = rows[-1]
    assert (m["async/staleness_0"], m["async/staleness_1"], m["async/staleness_2"]) == (0.5, 0.25, 0.25)
    assert m["endpoint/episodes"] == 4.0
    trainer, _ = small_trainer(tmp_path / "prompts")  # prompts in sync mode: bound 0, one bucket
    rows = []
    trainer.run(on_step=lambda step, metrics: rows.append(metrics))
    assert "async/staleness_1" not in rows[-1] and rows[-1]["async/staleness_0"] == 1.0
