"""Asynchronous training end to end on the real stack (Ray + vLLM CPU + DeepSpeed CPU): generation
runs ahead of the learner by a bounded number of policy versions, which every sample records; an
async run resumes to the same metrics as an uninterrupted one; an in_flight checkpoint keeps the samples it cut
(a one_step engine killed mid-generation: tests/e2e/orchestrator/test_watchdog_e2e.py)."""

import json
import shutil
import time

import pytest
import ray

from orchestrator.loop.trainer import Trainer
from runtime.actors import restart_count
from tests.e2e.orchestrator.test_train_e2e import config, metrics, train

pytestmark = pytest.mark.e2e
SAME = ("timing/", "throughput/", "learner/tokens_per_s", "pipeline/")  # wall-clock metrics differ run to run


def rows(run_dir):
    return [r for r in metrics(run_dir) if "timing/total" in r]


def test_full_async_keeps_the_staleness_bound_corrects_off_policy_and_resumes_identically(
    ray_cluster, policy, tmp_path
):
    over = {
        "async_training.mode": "full",
        "async_training.max_staleness": 2,
        "algorithm.off_policy.correction": "tis",
        "total_steps": 5,
        "checkpoint.every_n_steps": 2,
        "checkpoint.keep_last": 5,
    }
    train(config(policy, tmp_path, name="whole", **over))
    whole = rows(tmp_path / "whole")
    assert [r["step"] for r in whole] == [1, 2, 3, 4, 5]
    for r in whole:  # step s trains at policy version s - 1; its batch was launched min(s - 1, 2) versions before
        lag = min(r["step"] - 1, 2)
        assert r["async/staleness_max"] == r["async/staleness_mean"] == lag and r[f"async/staleness_{lag}"] == 1.0
        assert r["async/dropped_stale"] == 0
    # samples from an older policy: the learner's ratio to them moved off 1, and TIS reports what it cut
    assert all(r["off_policy/ratio_max"] > 1.01 for r in whole[2:])
    assert all(0.0 <= r["off_policy/clipped_frac"] < 0.5 for r in whole)
    assert whole[-1]["kl/ref"] > 0 and all(0.0 <= r["pipeline/idle/rollout"] <= 1.0 for r in whole)
    assert (tmp_path / "whole" / "pipeline.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "whole" / "checkpoints" / "step_2" / "orchestrator.json").read_text())
    assert [a["step"] for a in saved["ahead"]] == [2, 3]  # the batches generated ahead travel with the checkpoint

    crashed = tmp_path / "crashed"  # a copy of the run as it was after step 2, resumed with resume=auto
    (crashed / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step_2", crashed / "checkpoints" / "step_2")
    for name in ("eval_before.json", "eval_reference_samples.json"):
        shutil.copy(tmp_path / "whole" / name, crashed)
    (crashed / "metrics.jsonl").write_text(
        "".join(line + "\n" for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()[:2])
    )
    train(config(policy, tmp_path, name="crashed", **over, **{"checkpoint.resume": "auto"}))
    got = rows(crashed)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for w, g in zip(whole[2:], got[2:]):
        same = {k for k in w if not k.startswith(SAME)}
        assert {k: g[k] for k in same} == {k: w[k] for k in same}, g["step"]


def trained_batches(trainer, hold: bool = False) -> list:
    """Record the samples of every batch the learner trains on (PromptBatches.next), in order. `hold`:
    once a step's batch is collected, let the batch launched ahead sample a few tokens, then freeze it
    (RolloutWorker.hold) until the step's checkpoint has cut it: the cut lands mid-sequence at a set
    point, not at whatever point the machine's speed puts it."""
    got, next_batch, save = [], trainer.batches.next, trainer.save
    worker = trainer.roles.rollout.workers[0]

    def recording(step):
        this = next_batch(step)
        b = this.rollouts
        got.append(list(zip(b.prompt_index, b.prompt_ids, b.response_ids, b.logprobs, b.finish_reason)))
        ahead = [job.pending for job in trainer.batches.launched if job.pending is not None]
        if hold and ahead and reached(worker, ahead[0], 3):
            ray.get(worker.hold.remote(True))
        return this

    def saving():
        try:
            return save()
        finally:
            if hold:
                ray.get(worker.hold.remote(False))

    trainer.batches.next, trainer.save = recording, saving
    return got


def reached(worker, pending: list, tokens: int) -> bool:
    """Wait until some unfinished sequence on the worker has sampled `tokens`; False if the call
    `pending` returned first. Bounded by the call."""
    while not all(ray.wait([ref], timeout=0)[0] for ref in pending):
        if max(ray.get(worker.sampled_so_far.remote()), default=0) >= tokens:
            return True
        time.sleep(0.01)
    return False


def continues(saved: dict, trained: list) -> int:
    """Check that a trained batch is the checkpoint's batch ahead with its cut samples continued: the
    same prompts, each finished sample as saved, each cut one extended from what it had sampled.
    Returns the samples cut with tokens already sampled."""
    assert len(trained) == len(saved["response_ids"])
    extended = 0
    for i, (index, prompt, response, logprobs, finish) in enumerate(trained):
        assert (index, prompt) == (saved["prompt_index"][i], saved["prompt_ids"][i]) and finish != "partial"
        cut, before = saved["finish_reason"][i] == "partial", saved["response_ids"][i]
        if not cut:
            assert (response, logprobs, finish) == (before, saved["logprobs"][i], saved["finish_reason"][i])
        else:
            assert response[: len(before)] == before and logprobs[: len(before)] == saved["logprobs"][i]
            assert len(response) > len(before)
            extended += len(before) > 0
    return extended


def test_in_flight_checkpoints_keep_cut_samples_which_the_run_and_a_resumed_run_continue(
    ray_cluster, tiny_model, tmp_path
):
    """Partial rollouts: an in_flight checkpoint cuts the batch ahead mid-sequence and keeps what it
    sampled; the run, and a run resumed from that checkpoint by a new driver, train on exactly those
    samples continued: none lost, repeated or sampled again. The engine is killed after the first
    checkpoint, so the run's continuation meets a dead engine: restarted, it continues the same cuts.
    A random model rambles to its budget, 4 samples decoding at a time; the batch ahead is held
    mid-sequence until each checkpoint cuts it (trained_batches), so the in-flight sync lands while
    its samples are unfinished: they train with tokens of two versions, every token within the bound."""
    over = {
        "async_training.mode": "in_flight",
        "async_training.max_staleness": 1,
        "algorithm.off_policy.correction": "tis",
        "data.rollout_batch_size": 4,
        "rollout.sampling.n_samples_per_prompt": 4,
        "algorithm.mini_batch_size": 16,
        "algorithm.micro_batch_size": 16,
        "rollout.max_model_len": 96,
        "rollout.sampling.max_new_tokens": 60,
        "rollout.max_num_seqs": 4,
        "total_steps": 3,
        "eval.every_n_steps": 0,  # an evaluation would wait on the held engine
        "rollout.sync_check": "false",  # so would the sync check's probe (tests/e2e/learner/test_learner_sync.py)
        "checkpoint.every_n_steps": 1,
        "checkpoint.keep_last": 5,
    }
    trainer = Trainer(config(tiny_model, tmp_path, name="cut", **over))
    whole = trained_batches(trainer, hold=True)

    def kill_engine(step, metrics):
        if step == 1:  # and wait until Ray has taken it down: the continuation then meets the restarted engine
            worker = trainer.roles.rollout.workers[0]
            ray.kill(worker, no_restart=False)
            for _ in range(3000):  # a hang guard only: Ray takes the actor down in well under a second
                if restart_count(worker) == 1:
                    break
                time.sleep(0.1)

    try:
        trainer.run(on_step=kill_engine)
    finally:
        trainer.shutdown()
    saved = [
        json.loads((tmp_path / "cut" / "checkpoints" / f"step_{s}" / "orchestrator.json").read_text()) for s in (1, 2)
    ]
    for s, state in zip((1, 2), saved):
        assert [a["step"] for a in state["ahead"]] == [s]
    # both cuts landed mid-sequence: some samples had sampled tokens, and the continuation extended them
    assert (
        continues(saved[0]["ahead"][0]["batch"], whole[1]) > 0
        and continues(saved[1]["ahead"][0]["batch"], whole[2]) > 0
    )
    got = rows(tmp_path / "cut")
    assert [r["step"] for r in got] == [1, 2, 3] and got[-1]["restarts/rollout"] == 1
    assert got[-1]["async/continued_samples"] > 0 and all(r["async/dropped_stale"] == 0 for r in got)
    for r in got:
        assert r["async/token_staleness_max"] <= 1 and r["async/staleness_max"] <= 1
        # tokens are newer than their sample's first: the per-token mean is at most the per-sample one
        assert r["async/token_staleness_mean"] <= r["async/staleness_mean"]
    assert all(r["async/mixed_version_frac"] > 0 for r in got[1:])  # the continued samples span two versions

    resumed = tmp_path / "resumed"  # a new driver, from the checkpoint after step 1
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "cut" / "checkpoints" / "step_1", resumed / "checkpoints" / "step_1")
    for name in ("eval_before.json", "eval_reference_samples.json"):
        shutil.copy(tmp_path / "cut" / name, resumed)
    trainer = Trainer(config(tiny_model, tmp_path, name="resumed", **over, **{"checkpoint.resume": "auto"}))
    again = trained_batches(trainer)
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    assert continues(saved[0]["ahead"][0]["batch"], again[0]) > 0
    assert [[s[:2] for s in b] for b in again] == [[s[:2] for s in b] for b in whole[1:]]  # the same prompts, in order
