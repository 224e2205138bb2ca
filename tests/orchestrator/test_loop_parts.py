"""Parts of the training loop that need no Ray: batch statistics with dropped samples, dynamic
sampling's choice, the non-finite stop, held-out splits, checkpoint publishing, sampling checks."""
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from learner.checkpoint import publish, recover
from orchestrator.config import DataConfig
from orchestrator.data import DataError, load_split
from orchestrator.load_config import ConfigError, load_config
from orchestrator.phases import TrainingError, batch_metrics, pick_groups
from orchestrator.trainer import Trainer
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_cpu.yaml"


def test_dropped_samples_are_counted_and_left_out_of_reward_statistics():
    # prompt 0: rewards [1, 0, dropped]; prompt 1: [dropped, dropped, 1] -> one sample left
    n = 6
    batch = RolloutBatch([0, 0, 0, 1, 1, 1], [[1]] * n, [[2]] * n, [[0.0]] * n, ["x"] * n, ["stop"] * n)
    valid = [True, True, False, False, False, True]
    scored = ScoredBatch([1.0, 0.0, 0.0, 0.0, 0.0, 1.0], {}, valid, [not v for v in valid], [[0.0]] * n)
    m = batch_metrics(batch, scored)
    assert m["reward/dropped_samples"] == 3 and m["reward/dropped_groups"] == 1
    assert m["reward/mean"] == pytest.approx(2 / 3) and m["reward/min"] == 0.0  # over the 3 that train


def test_dynamic_sampling_counts_every_generated_group_it_does_not_train_on():
    # generated in order: equal, informative, equal, informative, informative; 3 wanted
    groups = [("a", False), ("b", True), ("c", False), ("d", True), ("e", True)]
    chosen, dropped = pick_groups(groups, 3)
    assert [g[0] for g in chosen] == ["b", "d", "e"] and dropped == 2
    # short of informative groups, equal ones fill the batch and only the rest count as dropped
    chosen, dropped = pick_groups(groups, 4)
    assert [g[0] for g in chosen] == ["b", "d", "e", "a"] and dropped == 1


def stats(skipped: bool, **nonfinite):
    return {"learner/skipped_steps": float(skipped), "learner/nonfinite_losses": float(skipped),
            **{f"learner/nonfinite/{k}": 1.0 for k in nonfinite}}


def test_a_run_of_skipped_updates_stops_the_run_naming_the_cause():
    loop = SimpleNamespace(step=0, counters={"learner/skipped_updates_in_a_row": 0},
                           cfg=SimpleNamespace(algorithm=SimpleNamespace(max_skipped_updates=2)))
    Trainer.check_finite(loop, stats(True, old_logprobs=True))
    Trainer.check_finite(loop, stats(False))  # a good update resets the count
    Trainer.check_finite(loop, stats(True, old_logprobs=True))
    Trainer.check_finite(loop, stats(True, old_logprobs=True))
    with pytest.raises(TrainingError, match="3 updates in a row .*temperature of 0"):
        Trainer.check_finite(loop, stats(True, old_logprobs=True))
    loop.counters["learner/skipped_updates_in_a_row"] = 0
    for _ in range(2):
        Trainer.check_finite(loop, stats(True))
    with pytest.raises(TrainingError, match="inputs were finite.*learner.lr"):
        Trainer.check_finite(loop, stats(True))
    loop.cfg.algorithm.max_skipped_updates = 0  # 0: never stop
    for _ in range(10):
        Trainer.check_finite(loop, stats(True))


def test_temperature_zero_is_rejected_for_training_with_the_reason():
    with pytest.raises(ConfigError, match="rollout.sampling.temperature: must be > 0 for training.*eval.greedy"):
        load_config(DEFAULT, ["rollout.sampling.temperature=0"])


def test_held_out_examples_are_removed_from_the_training_set(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(50)))
    cfg = DataConfig(train_files=[str(data)], eval_size=10)
    train, held_out, _ = load_split(cfg, seed=0)
    prompts = lambda rows: {e["prompt"] for e in rows}  # noqa: E731
    assert len(train) == 40 and len(held_out) == 10 and not prompts(train) & prompts(held_out)
    assert prompts(held_out) != {f"{i}+1=" for i in range(10)}  # drawn at random, not the file's first lines
    assert load_split(cfg, seed=0)[1] == held_out  # and reproducibly
    with pytest.raises(DataError, match="leave none to train on"):
        load_split(DataConfig(train_files=[str(data)], eval_size=50), seed=0)


def test_a_crash_while_replacing_a_checkpoint_never_loses_it(tmp_path, monkeypatch):
    final, tmp = tmp_path / "step_4", tmp_path / "step_4.tmp"
    final.mkdir(), (final / "state").write_text("old")
    tmp.mkdir(), (tmp / "state").write_text("new")
    real_replace = os.replace

    def crash_on_the_new_one(src, dst):
        if Path(src) == tmp:
            raise OSError("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_the_new_one)
    with pytest.raises(OSError):
        publish(tmp, final)
    monkeypatch.setattr(os, "replace", real_replace)
    recover(final)  # what resume does first
    assert (final / "state").read_text() == "old"
    publish(tmp, final)
    assert (final / "state").read_text() == "new" and not tmp.exists() and not (tmp_path / "step_4.old").exists()


def test_evaluation_honours_eval_greedy_and_reads_only_raw_scores():
    from orchestrator.evaluate import evaluate_policy

    calls = []

    def generate(prompts, greedy):
        calls.append(("generate", greedy))
        n = len(prompts) * (1 if greedy else 2)
        return RolloutBatch([i // (1 if greedy else 2) for i in range(n)], [[1]] * n, [[2, 3]] * n, [[-0.5, -0.5]] * n,
                            ["7"] * n, ["stop"] * n)

    def score(batch, meta, temperature, with_reference):
        calls.append(("score", with_reference))
        n = len(batch)
        return ScoredBatch([1.0] * n, {"math_answer": [1.0] * n}, [True] * n, [False] * n,
                           [[-1.0, -1.0] if with_reference else [] for _ in range(n)])

    def policy_logprobs(batch):  # the learner's own, not the engine's -0.5
        calls.append(("policy_logprobs", len(batch)))
        return [[-0.75, -0.25]] * len(batch)

    ev = evaluate_policy(generate, score, ["1+6="] * 3, [{"answer": "7"}] * 3, greedy=True, temperature=1.0,
                         policy_logprobs=policy_logprobs)
    assert calls == [("generate", True), ("score", False), ("generate", False), ("score", True), ("policy_logprobs", 6)]
    # KL per token from the policy's logprobs (mean of -0.75+1 and -0.25+1), not from the engine's
    assert ev.metrics["eval/greedy/reward/accuracy"] == 1.0 and ev.metrics["eval/sampled/kl_ref"] == pytest.approx(0.5)
    ev = evaluate_policy(generate, score, ["1+6="] * 3, [{"answer": "7"}] * 3, greedy=True, temperature=1.0,
                         policy_logprobs=lambda b: [[-1.0, -1.0]] * len(b))
    assert ev.metrics["eval/sampled/kl_ref"] == 0.0  # a policy equal to its reference: exactly 0
    calls.clear()
    ev = evaluate_policy(generate, score, ["1+6="] * 3, [{"answer": "7"}] * 3, greedy=False, temperature=1.0,
                         policy_logprobs=policy_logprobs)
    assert calls == [("generate", False), ("score", True), ("policy_logprobs", 6)] and ev.greedy is None
    assert not any(k.startswith("eval/greedy/") for k in ev.metrics) and ev.metrics["eval/sampled/reward/mean"] == 1.0


def test_dapo_clip_higher_is_set_from_config():
    assert load_config(DEFAULT, ["algorithm.clip_eps_high=0.28"]).algorithm.clip_eps_high == 0.28
    with pytest.raises(ConfigError, match="algorithm.clip_eps_high: must be >= 0"):
        load_config(DEFAULT, ["algorithm.clip_eps_high=-0.1"])


def test_a_group_baseline_needs_groups():
    over = ["algorithm.estimator=reinforce_baseline", "rollout.sampling.n_samples_per_prompt=1",
            "algorithm.mini_batch_size=64", "algorithm.micro_batch_size=64"]
    with pytest.raises(ConfigError, match="algorithm.reinforce_baseline: a group baseline needs >= 2"):
        load_config(DEFAULT, over)
    assert load_config(DEFAULT, over + ["algorithm.reinforce_baseline=batch"]).algorithm.reinforce_baseline.value == "batch"


@pytest.mark.parametrize("sleep", [True, False])
def test_colocated_engines_sleep_around_the_update_and_wake_before_the_sync(sleep):
    """The call sequence of one training step (recorded; on GPU the memory itself is in
    scripts/gpu_check.sh): engines asleep only while the learner updates, awake for the sync."""
    from rollout.pool import RolloutPool

    calls = []
    n = 4
    batch = RolloutBatch([0, 0, 1, 1], [[1]] * n, [[2]] * n, [[0.0]] * n, ["x"] * n, ["stop"] * n)
    scored = ScoredBatch([1.0, 0.0, 1.0, 1.0], {}, [True] * n, [False] * n, [[0.0]] * n)
    engines = SimpleNamespace(sleep=lambda: calls.append("sleep"), wake_up=lambda: calls.append("wake_up"))
    stats = {"kl/ref_seq": 0.0, "learner/skipped_steps": 0.0, "learner/nonfinite_losses": 0.0}
    batch.version_first = [0] * n
    loop = SimpleNamespace(
        cfg=SimpleNamespace(data=SimpleNamespace(dynamic_sampling=False), logging=SimpleNamespace(profile_step=0)),
        step=0, counters={}, sleep_engines=sleep, lead=0,
        next_batch=lambda: (calls.append("generate"), (batch, [{}, {}], None))[1],
        score=lambda b, e, judged: (calls.append("score"), scored)[1],
        _judge_next=lambda: calls.append("judge_next"), _busy=lambda: {"rollout": [0.0], "scoring": [0.0]},
        rollout=SimpleNamespace(asleep=lambda enabled: RolloutPool.asleep(engines, enabled)),
        scoring=SimpleNamespace(restarts=0),
        learner=SimpleNamespace(update=lambda b, s, step: (calls.append("update"), stats)[1],
                                update_kl=lambda kl, n: (calls.append("update_kl"), 0.01)[1]),
        check_finite=lambda s: None, push=lambda version: calls.append(("sync", version)))
    Trainer.train_step(loop)
    middle = ["sleep", "update", "wake_up"] if sleep else ["update"]
    # the next batch's scoring is launched after this one's (the service runs its calls in order)
    assert calls == ["generate", "score", "judge_next", *middle, ("sync", 1), "update_kl"]


def test_only_the_next_batch_is_judged_ahead_once_from_its_pending_generation_or_its_samples():
    """Trainer._judge_next: the scoring service runs its calls in order, so a judge call queued behind a
    generation further ahead would hold up the next step's scoring; a batch generated again (stale,
    or its engine died) drops its judge call."""
    from collections import deque

    from orchestrator.phases import Ahead

    launched = []
    loop = SimpleNamespace(
        train=[{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}], _temperature=1.0, _meta=lambda e: e["prompt"],
        scoring=SimpleNamespace(judge_ahead=lambda parts, meta, t: launched.append((parts, meta)) or len(launched)),
        rollout=SimpleNamespace(submit=lambda prompts, step, tasks: ["regenerated"]), _prompt=lambda e: e["prompt"])
    nxt, after = Ahead(1, [0, 2], ["gen1"]), Ahead(2, [1], ["gen2"])
    loop.ahead = deque([nxt, after])
    Trainer._judge_next(loop)
    Trainer._judge_next(loop)  # already judged: not again
    assert launched == [(["gen1"], ["a", "c"])] and nxt.judged == 1 and after.judged is None
    Trainer._resubmit(loop, nxt)
    assert nxt.pending == ["regenerated"] and nxt.judged is None
    nxt.batch = "collected"  # e.g. restored from a checkpoint: judged from its samples
    Trainer._judge_next(loop)
    assert launched[-1] == (["collected"], ["a", "c"]) and nxt.judged == 2
    loop.ahead = deque()
    Trainer._judge_next(loop)  # sync mode: nothing ahead
    assert len(launched) == 2
