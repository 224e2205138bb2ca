"""Parts of the training loop that need no Ray: batch statistics with dropped samples, dynamic
sampling's choice, the non-finite stop, held-out splits, checkpoint publishing, sampling checks."""

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from learner.checkpoint import publish, recover
from orchestrator.config.load import ConfigError, load_config
from orchestrator.config.schema import DataConfig, EvalConfig
from orchestrator.data.prompts import DataError, load_split
from orchestrator.loop.batches import LaunchedBatch
from orchestrator.loop.dynamic_sampling import Group, Sampled, dynamic_sample, pick_groups
from orchestrator.loop.step_metrics import TrainingError, batch_metrics, check_progress
from reward_service.types import ScoredBatch
from rollout.config import SamplingConfig
from rollout.types import RolloutBatch
from runtime.seeds import EVALUATION
from tests.helpers import REPO
from tests.small_loop import samples, small_trainer

DEFAULT = REPO / "configs" / "grpo_tiny_cpu.yaml"
nan = float("nan")


def test_dropped_samples_are_counted_and_left_out_of_reward_statistics():
    # prompt 0: rewards [1, 0, dropped]; prompt 1: [dropped, dropped, 1] -> one sample left
    n = 6
    batch = RolloutBatch([0, 0, 0, 1, 1, 1], [[1]] * n, [[2]] * n, [[0.0]] * n, ["x"] * n, ["stop"] * n)
    valid = [True, True, False, False, False, True]
    scored = ScoredBatch(
        [1.0, 0.0, 0.0, 0.0, 0.0, 1.0],
        {},
        valid,
        [not v for v in valid],
        [[0.0]] * n,
        raw=[1.0, 0.0, nan, nan, nan, 1.0],
    )
    m = batch_metrics(batch, scored)
    assert m["reward/dropped_samples"] == 3 and m["reward/dropped_groups"] == 1
    assert m["reward/mean"] == pytest.approx(2 / 3) and m["reward/min"] == 0.0  # over the 3 that train


def test_dynamic_sampling_counts_every_generated_group_it_does_not_train_on():
    # generated in order: equal, informative, equal, informative, informative; 3 wanted
    groups = [Group(None, None, {"prompt": p}, good) for p, good in zip("abcde", [False, True, False, True, True])]
    chosen, dropped = pick_groups(groups, 3)
    assert [g.example["prompt"] for g in chosen] == ["b", "d", "e"] and dropped == 2
    # short of informative groups, equal ones fill the batch and only the rest count as dropped
    chosen, dropped = pick_groups(groups, 4)
    assert [g.example["prompt"] for g in chosen] == ["b", "d", "e", "a"] and dropped == 1


def stats(skipped: bool, **nonfinite):
    return {
        "learner/skipped_steps": float(skipped),
        "learner/nonfinite_losses": float(skipped),
        **{f"learner/nonfinite/{k}": 1.0 for k in nonfinite},
    }


def judged(n=2):
    return ScoredBatch([1.0] * n, {}, [True] * n, [False] * n, [[0.0]] * n, raw=[1.0] * n)


def test_a_run_of_skipped_updates_stops_the_run_naming_the_cause():
    counters = {"learner/skipped_updates_in_a_row": 0, "reward/unjudged_steps_in_a_row": 0}
    check = lambda s, limit=2: check_progress(counters, s, judged(), limit, 3, 0)  # noqa: E731
    check(stats(True, old_logprobs=True))
    check(stats(False))  # a good update resets the count
    check(stats(True, old_logprobs=True))
    check(stats(True, old_logprobs=True))
    with pytest.raises(TrainingError, match="3 updates in a row .*temperature of 0"):
        check(stats(True, old_logprobs=True))
    counters["learner/skipped_updates_in_a_row"] = 0
    for _ in range(2):
        check(stats(True))
    with pytest.raises(TrainingError, match="inputs were finite.*learner.lr"):
        check(stats(True))
    for _ in range(10):
        check(stats(True), limit=0)  # 0: never stop


def nobody_answered(batch, k):
    n = 4
    return ScoredBatch(
        [0.0] * n,
        {"remote": [nan] * n, "format": [1.0, 0.0, nan, 1.0]},
        [False] * n,
        [True] * n,
        [[0.0]] * n,
        raw=[nan] * n,
        metrics={"reward/timeouts": 1.0},
        errors={"remote": "http://rm:8000/score: unreachable: [Errno 111] Connection refused"},
    )


def test_steps_in_which_no_sample_could_be_judged_stop_the_run_naming_the_source_and_its_error(tmp_path):
    """Review A, item 6: a reward server that is down made every sample invalid; the run trained on
    nothing (invalid: drop) for every step and "finished" with the policy unchanged."""
    trainer, _ = small_trainer(tmp_path / "a", "reward.max_unjudged_steps=3", "total_steps=5", judge=nobody_answered)
    steps = []
    with pytest.raises(
        TrainingError,
        match=r"no sample could be judged in 3 steps in a row "
        r"\(reward.max_unjudged_steps: 3\); remote failed on 4 of 4 samples: "
        r"http://rm:8000/score: unreachable.*refused; "
        r"format failed on 1 of 4 samples: no error raised",
    ):
        trainer.run(on_step=lambda step, m: steps.append(step))
    assert steps == [1, 2]  # the third step raised
    # one step with a judged sample resets the count; 0 never stops
    judge = lambda batch, k: judged(4) if k == 1 else nobody_answered(batch, k)  # noqa: E731
    trainer, _ = small_trainer(tmp_path / "b", "reward.max_unjudged_steps=2", judge=judge)
    rows = []
    trainer.run(on_step=lambda step, m: rows.append(m["reward/unjudged_steps_in_a_row"]))
    assert rows == [1, 0, 1]
    trainer, _ = small_trainer(tmp_path / "c", "reward.max_unjudged_steps=0", "total_steps=5", judge=nobody_answered)
    rows = []
    trainer.run(on_step=lambda step, m: rows.append(m["reward/unjudged_steps_in_a_row"]))
    assert rows == [1, 2, 3, 4, 5]


def test_dynamic_sampling_reports_the_trained_batch_and_every_rounds_calls():
    """Review A, item 5: the reward metrics of a dynamic-sampling step were those of the first chosen
    group's whole round. Round 0: group 0 all correct (not informative), group 1 [1, 0]; round 1:
    one group [0, 1]. Trained: groups [1, 0] and [0, 1], so accuracy 0.5 (round 0's batch: 0.75)."""

    def scored_of(values, timeouts):
        n = len(values)
        return ScoredBatch(
            list(values),
            {"math_answer": list(values)},
            [True] * n,
            [False] * n,
            [[0.0]] * n,
            raw=list(values),
            metrics={"reward/timeouts": timeouts, "reward/errors": timeouts},
            errors={"math_answer": f"round with {timeouts} timeouts"},
        )

    def batch_of(groups):
        n = 2 * groups
        return RolloutBatch([i // 2 for i in range(n)], [[1]] * n, [[2]] * n, [[0.0]] * n, ["x"] * n, ["stop"] * n)

    asked = []

    def sample_more(n):
        asked.append(n)
        return Sampled(batch_of(1), [{"prompt": "c"}], scored_of([0.0, 1.0], 2.0))

    first = Sampled(batch_of(2), [{"prompt": "a"}, {"prompt": "b"}], scored_of([1.0, 1.0, 1.0, 0.0], 1.0))
    kept, dropped = dynamic_sample(first, want=2, rounds=1, sample_more=sample_more)
    batch, examples, scored = kept.rollouts, kept.examples, kept.scored
    assert asked == [1] and [e["prompt"] for e in examples] == ["b", "c"] and dropped == 1
    assert batch.prompt_index == [0, 0, 1, 1]
    m = batch_metrics(batch, scored)
    assert m["reward/accuracy"] == 0.5 and m["reward/math_answer/mean"] == 0.5 and m["reward/mean"] == 0.5
    assert m["reward/timeouts"] == 3.0 and m["reward/errors"] == 3.0  # both rounds' calls, summed
    assert scored.errors == {"math_answer": "round with 1.0 timeouts"}  # the first error


def test_accuracy_and_reward_mean_are_over_the_same_samples():
    """Review A, item 13: accuracy was over every sample the verifiable source judged, including one
    dropped because another (trained) source failed on it. Sample 2: math right, format failed."""
    n = 3
    scored = ScoredBatch(
        [0.0] * n,
        {"math_answer": [1.0, 0.0, 1.0], "format": [0.5, 0.5, nan]},
        [True, True, False],
        [False, False, True],
        [[0.0]] * n,
        raw=[1.5, 0.5, nan],
    )
    batch = RolloutBatch([0, 0, 0], [[1]] * n, [[2]] * n, [[0.0]] * n, ["x"] * n, ["stop"] * n)
    m = batch_metrics(batch, scored)
    assert m["reward/accuracy"] == 0.5 and m["reward/mean"] == 1.0  # samples 0 and 1 both
    assert m["reward/math_answer/mean"] == pytest.approx(2 / 3)  # the source's own mean: all it judged
    assert m["reward/format/invalid_frac"] == pytest.approx(1 / 3) and m["reward/invalid_frac"] == pytest.approx(1 / 3)
    from orchestrator.tools.evaluate import evaluate_policy

    ev = evaluate_policy(lambda p, greedy: batch, lambda *a: scored, [""], [{}], False, 1.0, lambda b: [[0.0]] * n)
    assert ev.metrics["eval/sampled/reward/accuracy"] == 0.5 and ev.metrics["eval/sampled/reward/mean"] == 1.0


def test_a_scored_batch_needs_its_raw_reward():
    """Review A, item 17: a caller that forgot raw silently got reward/* of the shaped rewards."""
    with pytest.raises(TypeError, match="raw"):
        ScoredBatch([0.5], {}, [True], [False], [[0.0]])
    with pytest.raises(ValueError, match="raw has 0 entries for 1 rewards"):
        ScoredBatch([0.5], {}, [True], [False], [[0.0]], raw=[])
    assert math.isnan(
        batch_metrics(
            RolloutBatch([0], [[1]], [[2]], [[0.0]], ["x"], ["stop"]),
            ScoredBatch([0.0], {}, [False], [True], [[0.0]], raw=[nan]),
        )["reward/mean"]
    )


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
    from orchestrator.tools.evaluate import evaluate_policy

    calls = []

    def generate(prompts, greedy):
        calls.append(("generate", greedy))
        n = len(prompts) * (1 if greedy else 2)
        return RolloutBatch(
            [i // (1 if greedy else 2) for i in range(n)],
            [[1]] * n,
            [[2, 3]] * n,
            [[-0.5, -0.5]] * n,
            ["7"] * n,
            ["stop"] * n,
        )

    def score(batch, meta, temperature, with_reference):
        calls.append(("score", with_reference))
        n = len(batch)
        return ScoredBatch(
            [1.0] * n,
            {"math_answer": [1.0] * n},
            [True] * n,
            [False] * n,
            [[-1.0, -1.0] if with_reference else [] for _ in range(n)],
            raw=[1.0] * n,
        )

    def policy_logprobs(batch):  # the learner's own, not the engine's -0.5
        calls.append(("policy_logprobs", len(batch)))
        return [[-0.75, -0.25]] * len(batch)

    ev = evaluate_policy(
        generate,
        score,
        ["1+6="] * 3,
        [{"answer": "7"}] * 3,
        greedy=True,
        temperature=1.0,
        policy_logprobs=policy_logprobs,
    )
    assert calls == [("generate", True), ("score", False), ("generate", False), ("score", True), ("policy_logprobs", 6)]
    # KL per token from the policy's logprobs (mean of -0.75+1 and -0.25+1), not from the engine's
    assert ev.metrics["eval/greedy/reward/accuracy"] == 1.0 and ev.metrics["eval/sampled/kl_ref"] == pytest.approx(0.5)
    ev = evaluate_policy(
        generate,
        score,
        ["1+6="] * 3,
        [{"answer": "7"}] * 3,
        greedy=True,
        temperature=1.0,
        policy_logprobs=lambda b: [[-1.0, -1.0]] * len(b),
    )
    assert ev.metrics["eval/sampled/kl_ref"] == 0.0  # a policy equal to its reference: exactly 0
    calls.clear()
    ev = evaluate_policy(
        generate,
        score,
        ["1+6="] * 3,
        [{"answer": "7"}] * 3,
        greedy=False,
        temperature=1.0,
        policy_logprobs=policy_logprobs,
    )
    assert calls == [("generate", False), ("score", True), ("policy_logprobs", 6)] and ev.greedy is None
    assert not any(k.startswith("eval/greedy/") for k in ev.metrics) and ev.metrics["eval/sampled/reward/mean"] == 1.0


def test_dapo_clip_higher_is_set_from_config():
    assert load_config(DEFAULT, ["algorithm.clip_eps_high=0.28"]).algorithm.clip_eps_high == 0.28
    with pytest.raises(ConfigError, match="algorithm.clip_eps_high: must be >= 0"):
        load_config(DEFAULT, ["algorithm.clip_eps_high=-0.1"])


def test_a_group_baseline_needs_groups():
    over = [
        "algorithm.estimator=reinforce_baseline",
        "rollout.sampling.n_samples_per_prompt=1",
        "algorithm.mini_batch_size=64",
        "algorithm.micro_batch_size=64",
    ]
    with pytest.raises(ConfigError, match="algorithm.reinforce_baseline.baseline: a group baseline needs >= 2"):
        load_config(DEFAULT, over)
    assert (
        load_config(
            DEFAULT, over + ["algorithm.reinforce_baseline.baseline=batch"]
        ).algorithm.reinforce_baseline.baseline.value
        == "batch"
    )


@pytest.mark.parametrize("sleep", [True, False])
def test_colocated_engines_sleep_around_the_update_and_wake_before_the_sync(sleep, tmp_path):
    """The call sequence of one training step (recorded; on GPU the memory itself is in
    scripts/gpu_check.sh): engines asleep only while the learner computes advantages and trains,
    awake for the sync; the reference phase follows the rewards."""
    trainer, calls = small_trainer(tmp_path, "async_training.mode=one_step", sleep_engines=sleep)
    trainer.run(on_step=lambda step, metrics: True)  # one step
    step = calls[: [i for i, c in enumerate(calls) if c[0] == "update_kl"][0] + 1]
    middle = ["sleep", "experience", "train", "wake_up"] if sleep else ["experience", "train"]
    # step 1's batch is launched ahead; the next batch's scoring is launched after this one's (the
    # service runs its calls in order)
    assert step == [
        ("submit", 0, 2),
        ("submit", 1, 4),
        "generate",
        "score",
        "reference",
        ("judge_ahead", [(2, 1)], ["3", "4"]),
        *middle,
        ("sync", 1),
        ("update_kl", 0.0, 4),
    ]


def test_only_the_next_batch_is_judged_ahead_once_from_its_pending_generation_or_its_samples(tmp_path):
    """PromptBatches.score_next_ahead: the scoring service runs its calls in order, so a judge call
    queued behind a generation further ahead would hold up the next step's scoring; a batch
    generated again (stale, or its engine died) drops its judge call."""
    from collections import deque

    trainer, calls = small_trainer(tmp_path, "async_training.mode=full")
    batches = trainer.batches
    nxt, after = LaunchedBatch(1, [0, 2], ["gen1"]), LaunchedBatch(2, [1], ["gen2"])
    batches.launched = deque([nxt, after])
    batches.score_next_ahead()
    batches.score_next_ahead()  # already judged: not again
    assert calls == [("judge_ahead", ["gen1"], ["1", "3"])] and nxt.scoring == 1 and after.scoring is None
    batches.relaunch_uncollected()  # an engine restarted: both generated again
    assert nxt.pending == [(2, 1)] and nxt.scoring is None and after.pending == [(1, 2)]
    nxt.batch, nxt.pending = samples(2, 2, 1), None  # e.g. restored from a checkpoint: judged from its samples
    batches.score_next_ahead()
    assert calls[-1] == ("judge_ahead", [nxt.batch], ["1", "3"]) and nxt.scoring == len(calls)
    batches.launched = deque()
    batches.score_next_ahead()  # sync mode: nothing ahead
    assert sum(c[0] == "judge_ahead" for c in calls) == 2


def test_relay_eval_scores_the_reference_with_the_services_model_and_frees_the_policy_copy(tiny_model, monkeypatch):
    """Review A, item 11: relay eval loaded a reference copy per role beside the scoring service's own
    reference, so three full models at once in the driver. Now: one copy, the policy's, gone before
    the reference role runs; the reference role's KL side is the service's model itself."""
    import gc
    import weakref

    from orchestrator.tools.evaluate import evaluate_roles
    from reward_service import reference

    service_model = reference.ReferenceModel(tiny_model)
    built, alive = [], []

    class Counted(reference.ReferenceModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(weakref.ref(self))

    monkeypatch.setattr(reference, "ReferenceModel", Counted)
    n = 2
    batch = RolloutBatch(
        [0, 1], [[5, 6], [7]], [[8, 9], [10, 11, 12]], [[-1.0, -1.0], [-1.0] * 3], ["x"] * n, ["stop"] * n
    )

    class Pool:
        def __init__(self, path):
            self.path = path

        def generate(self, prompts, step, greedy, sampling, tasks, draw):
            assert draw == EVALUATION  # relay eval samples from evaluation's own stream, as the trainer's does
            gc.collect()
            alive.append(sum(w() is not None for w in built))
            return batch

        def shutdown(self):
            pass

    def score(b, meta, temperature, with_reference):
        ref = service_model.logprobs(b, temperature) if with_reference else [[] for _ in range(len(b))]
        return ScoredBatch([1.0] * n, {}, [True] * n, [False] * n, ref, raw=[1.0] * n)

    cfg = SimpleNamespace(
        rollout=SimpleNamespace(sampling=SamplingConfig(temperature=1.0)), eval=EvalConfig(greedy=False)
    )
    scoring = SimpleNamespace(reference=service_model, evaluate=score)
    evals = evaluate_roles(cfg, tiny_model, tiny_model, scoring, ["a", "b"], [{}, {}], lambda path: Pool(path))
    assert len(built) == 1  # the policy's copy; none for the reference
    assert alive == [1, 0]  # while the policy generates, and freed before the reference's turn
    assert evals["reference"].metrics["eval/sampled/kl_ref"] == 0.0  # its own logprobs: the service's model


def test_checkpoints_keep_the_last_ones_with_the_batches_generated_ahead_and_resume_from_the_newest(tmp_path):
    """Checkpointer through the real loop: every step saved, keep_last kept, the batch launched ahead
    collected into the checkpoint (Trainer.save's explicit step), and a resume=auto run restores the
    newest: learner, scoring state, counts, the batch ahead, and the engines' weights."""
    over = ("async_training.mode=one_step", "total_steps=4", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2")
    trainer, _ = small_trainer(tmp_path, *over)
    ahead_at = {}

    def stop_after_two(step, metrics):
        ahead_at[step] = [job.step for job in trainer.batches.launched]
        return step == 2

    trainer.run(on_step=stop_after_two)
    root = trainer.run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"] and ahead_at == {1: [1], 2: [2]}
    state = json.loads((root / "step_2" / "orchestrator.json").read_text())
    assert state["step"] == 2 and [a["step"] for a in state["ahead"]] == [2] and state["ahead"][0]["batch"]
    assert state["scoring"] == {"running": "state"} and state["counters"]["rollout/dropped_groups"] == 0
    resumed, calls = small_trainer(tmp_path, *over, "checkpoint.resume=auto")
    assert resumed.step == 2 and calls == [("load", "step_2"), ("sync", 2)]
    assert resumed.roles.scoring.loaded == {"running": "state"}
    assert [job.step for job in resumed.batches.launched] == [2] and resumed.batches.launched[0].batch is not None
    assert resumed.batches.sampler.state_dict() == trainer.batches.sampler.state_dict()


class CuttingEngines:
    """A rollout pool whose samples run until cut (preempt): a cut call's samples have sampled one token
    (2) and are "partial"; a continuation (submit_resume) samples one more (3) and stops. `die` raises
    an engine's death at the next collect of a continuation, once."""

    def __init__(self, calls: list):
        self.calls, self.cut, self.die, self.preempt_dies, self.abort_all = calls, False, False, False, False

    def submit(self, prompts, step, tasks=None, draw=0) -> list:
        self.calls.append(("submit", step, draw))
        self.cut = False
        return [("generate", len(prompts), step)]

    def submit_resume(self, batch, rows, step, draw) -> list:
        self.calls.append(("resume", rows, step, draw))
        return [("resume", len(rows), step)]

    def preempt(self) -> int:
        self.calls.append("preempt")
        if self.preempt_dies:
            raise ray.exceptions.RayActorError()
        self.cut = True
        return 1

    def collect(self, pending: list) -> RolloutBatch:
        kind, n, step = pending[0]
        if kind == "resume" and self.die:
            self.die = False
            raise ray.exceptions.RayActorError()
        if kind == "resume":
            more = samples(n, 1, step + 10)
            more.response_ids, more.logprobs, more.token_versions = [[3]] * n, [[-0.3]] * n, [[step + 10]] * n
            if self.abort_all:  # an engine that aborts every continuation too
                more.finish_reason = ["partial"] * n
            return more
        batch = samples(n, 2, step)
        batch.token_versions = [[step, step]] * len(batch)
        if self.cut:
            batch.finish_reason = ["partial", "stop"] * n
        return batch


@pytest.mark.parametrize("engine_dies", [False, True])
def test_in_flight_checkpoints_cut_the_batches_ahead_and_continue_them_after_a_restore(tmp_path, engine_dies):
    """Partial rollouts: an in_flight checkpoint cuts the batch ahead (preempt) and keeps its samples
    as sampled; a restored PromptBatches continues exactly the cut ones, once each (also when an engine
    dies during the continuation: it is launched again), and trains on them joined token for token."""
    trainer, _ = small_trainer(tmp_path, "async_training.mode=in_flight", "async_training.max_staleness=1")
    calls, restarts = [], []
    batches = trainer.batches
    batches.rollout = CuttingEngines(calls)
    batches.restart_rollout = lambda error, step: restarts.append(step)
    first = batches.next(0)  # step 0's batch, and step 1's launched ahead
    assert [s[-1] for s in first.rollouts.token_versions] == [0] * 4
    batches.collect_launched(1)  # the checkpoint after step 1: cut where it is, not continued
    assert calls == [("submit", 0, 2), ("submit", 1, 4), "preempt"]
    state = json.loads(json.dumps(batches.state_dict()))  # as orchestrator.json keeps it
    assert state["ahead"][0]["batch"]["finish_reason"] == ["partial", "stop"] * 2

    restored, _ = small_trainer(tmp_path, "async_training.mode=in_flight", "async_training.max_staleness=1")
    again = restored.batches
    again.rollout, again.restart_rollout = batches.rollout, batches.restart_rollout
    batches.rollout.die = engine_dies
    again.load_state_dict(state, {"async/dropped_stale": 0, "async/continued_samples": 0})
    got = again.next(1).rollouts
    resumes = [c for c in calls if c[0] == "resume"]
    assert resumes == [("resume", [0, 2], 1, 4)] * (2 if engine_dies else 1) and restarts == [1] * engine_dies
    assert got.response_ids == [[2, 3, 3], [2, 3], [2, 3, 3], [2, 3]] and got.finish_reason == ["stop"] * 4
    assert got.logprobs[0] == [-0.5, -0.5, -0.3] and got.logprobs[1] == [-0.5, -0.5]
    assert got.token_versions == [[1, 1, 11], [1, 1], [1, 1, 11], [1, 1]]
    assert again.counts()["async/continued_samples"] == 2  # the cut samples, counted once


def test_only_the_groups_beyond_the_staleness_bound_are_dropped_and_fresh_prompts_take_their_place(tmp_path):
    """A batch ahead whose first prompt's samples are 2 versions old at step 2 (bound 1: a disturbed
    pipeline): that group is dropped and counted, the other trains as sampled, with its own versions,
    and the batch is topped up with a fresh prompt generated now."""
    from collections import deque

    trainer, calls = small_trainer(tmp_path, "async_training.mode=full", "async_training.max_staleness=1")
    batches = trainer.batches
    ahead = samples(2, 2, 1)
    ahead.version_first = ahead.version_last = [0, 0, 1, 1]
    ahead.token_versions = [[0, 0], [0, 1], [1, 1], [1, 1]]
    ahead.skipped = [(7, "too long")]
    batches.launched = deque([LaunchedBatch(2, [5, 6], None, ahead)])
    got = batches.next(2)
    b = got.rollouts
    assert batches.counts()["async/dropped_stale"] == 2 and calls[-2:] == [("submit", 2, 1), "generate"]
    assert b.prompt_index == [1, 1, 2, 2] and b.version_first == [1, 1, 2, 2]  # the kept group, then the top-up's
    assert b.token_versions[:2] == [[1, 1], [1, 1]] and b.skipped == [(7, "too long")]
    assert [e["answer"] for e in got.examples] == ["6", "7", "1"] and got.scoring_ahead is None


def test_a_checkpoint_whose_preempt_meets_a_dead_engine_restarts_it_and_keeps_the_batch_ahead_whole(tmp_path):
    trainer, _ = small_trainer(tmp_path, "async_training.mode=in_flight", "async_training.max_staleness=1")
    calls, restarts = [], []
    batches = trainer.batches
    batches.rollout, batches.restart_rollout = CuttingEngines(calls), lambda error, step: restarts.append(step)
    batches.next(0)
    batches.rollout.preempt_dies = True
    batches.collect_launched(1)
    assert restarts == [1] and calls[-2:] == ["preempt", ("submit", 1, 4)]  # launched again, not cut
    assert batches.launched[0].batch.partial_rows() == [] and batches.launched[0].pending is None


def test_samples_the_engine_aborts_again_and_again_stop_the_step_naming_it(tmp_path):
    trainer, _ = small_trainer(tmp_path, "async_training.mode=in_flight", "async_training.max_staleness=1")
    calls = []
    batches = trainer.batches
    batches.rollout = CuttingEngines(calls)
    batches.next(0)
    batches.collect_launched(1)
    batches.rollout.abort_all = True
    with pytest.raises(
        RuntimeError, match=r"step 1: the engine aborted 2 samples again and again \(continued 3 more times\)"
    ):
        batches.next(1)
    assert sum(c[0] == "resume" for c in calls if isinstance(c, tuple)) == 1 + 3
