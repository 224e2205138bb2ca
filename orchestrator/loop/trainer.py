"""The training loop: generate -> score -> update -> sync, one named, timed phase each."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import NoReturn

import ray

from orchestrator.config.load import to_dict
from orchestrator.config.schema import TrainConfig
from orchestrator.loop.batches import ahead_bound
from orchestrator.loop.checkpointer import Checkpointer
from orchestrator.loop.dynamic_sampling import Sampled, dynamic_sample
from orchestrator.loop.health import Health, applicable
from orchestrator.loop.incident import IncidentContext
from orchestrator.loop.loop_state import LoopState
from orchestrator.loop.parts import LoopParts, start_parts
from orchestrator.loop.profiling import profiled
from orchestrator.loop.recovery import LearnerRecovery
from orchestrator.loop.signals import Stopped, StopRequest
from orchestrator.loop.step_metrics import (
    batch_metrics,
    batch_staleness,
    busy_metrics,
    check_progress,
    finished_before,
    throughput_metrics,
    timed,
)
from orchestrator.loop.tracking import Tracker, say
from orchestrator.tools.eval_report import samples_table, summary_table
from orchestrator.tools.plots import plot_run
from runtime import watchdog
from runtime.watchdog import Watchdog, watching

StepHook = Callable[[int, dict], object]  # (step, metrics) after each step; a true return ends training there


class Trainer:
    """Owns the loop: the step (the policy version the engines hold) and the parts it drives (LoopParts:
    the roles, a batch source, the evaluator), with objects of their own for the loop's state and counts
    (LoopState), its checkpoints (Checkpointer), a learner's rebuild (LearnerRecovery), its records
    (Tracker) and what an incident folder says of it (IncidentContext)."""

    def __init__(self, cfg: TrainConfig, parts: LoopParts | None = None):
        self.cfg, self.run_dir, self.step = cfg, Path(cfg.run_root) / cfg.name, 0
        # first: the folder is this run's (another run's checkpoints and records set aside) before anything
        # can end the run, so its end line never names another run's checkpoint
        self.checkpointer = Checkpointer(self.run_dir, cfg.checkpoint.keep_last, cfg.checkpoint.resume)
        self.incident = IncidentContext(cfg, lambda: self.step)
        self.watchdog = Watchdog(cfg.watchdog, self.run_dir, self.incident.actors, self.incident)
        with watching(self.watchdog), self.watchdog.phase("start"):
            parts = parts or start_parts(cfg, self.run_dir)
        self.roles, self.batches, self.evaluator = parts.roles, parts.batches, parts.evaluator
        self.incident.roles = self.roles
        self.wait_for_sync = ahead_bound(cfg) == 0  # asynchronous modes train while the engines take weights
        self.health = Health(cfg.health, functools.partial(say, self.run_dir), applicable(cfg))
        self.state = LoopState(self.roles, self.batches, self.health, parts.skipped_lines, self._move_to)
        with watching(self.watchdog), self.watchdog.phase("start"):
            resumed_at = self.state.resume(self.checkpointer) if self.checkpointer.resume_from else None
        # with no checkpoint, a learner recovery goes back to the start: the loop's state kept here as a
        # checkpoint keeps it (the learner's is the model, rebuilt)
        start = None if resumed_at is not None else self.state.state_dict(self.step)
        self.finished = finished_before(self.run_dir, resumed_at, cfg.total_steps)
        self.tracker = Tracker(
            cfg.logging, self.run_dir, cfg.name, to_dict(cfg), resumed_at, self.finished, cfg.total_steps
        )
        r = cfg.cluster.max_restarts
        self.recovery = LearnerRecovery(self.roles, self.state, self.checkpointer, self.tracker, r, start)

    def run(self, stop: StopRequest | None = None, on_step: StepHook | None = None) -> dict:
        """Train to total_steps (or until `on_step` returns true), then evaluate held out. A stop request
        (loop/signals.py) is read between steps: the step in flight finishes, then _stop checkpoints.
        Every wait on a remote call has a deadline (runtime/watchdog.py)."""
        with watching(self.watchdog):
            return self._run(stop, on_step)

    def _run(self, stop: StopRequest | None, on_step: StepHook | None) -> dict:
        stop, saved_at, ended = stop or StopRequest(), None, False  # saved_at: the step this process last saved
        with watchdog.phase("evaluate") if self.step == 0 else nullcontext():  # resumed: read from the run folder
            before = self.evaluator.evaluate_before(self.step)
        self.health.before = before
        if self.step == 0:
            self.tracker.log_table("eval/samples", 0, self.evaluator.samples)
        while self.step < self.cfg.total_steps and not stop.requested and not ended:
            try:
                metrics, saved = self.advance()
            except ray.exceptions.RayActorError as e:
                if not self.roles.learner.lost(e):
                    raise
                self.recover_learner(e)  # back at the last checkpoint: the loop replays the steps after it
                continue
            saved_at = saved if saved is not None else saved_at
            ended = bool(on_step and on_step(self.step, metrics))
        if stop.requested:
            self._stop(stop.signal, saved_at)
        self.roles.finish_sync()
        after = self.evaluator.read_after() if self.finished else self._final_evaluation()
        print(summary_table(before, after), flush=True)
        if not self.finished:
            print(samples_table(self.evaluator.samples), flush=True)
        self.tracker.close()
        return after

    def advance(self) -> tuple[dict, int | None]:
        """One step: train, evaluate and checkpoint when due, log. Returns its metrics and the step saved (or None)."""
        metrics, saved = self.train_step(), None
        self.step += 1
        every, total = self.cfg.eval.every_n_steps, self.cfg.total_steps
        if every and self.step % every == 0 and self.step < total:
            metrics.update(self.evaluate())
            self.tracker.log_table("eval/samples", self.step, self.evaluator.samples)
        metrics.update(self.health.observe(self.step, metrics))
        self.tracker.log(self.step, metrics, total)
        self.incident.last_metrics = metrics
        every = self.cfg.checkpoint.every_n_steps
        if (every and self.step % every == 0) or self.step == total:
            saved = self.save()
        return metrics, saved

    def recover_learner(self, error: Exception) -> None:
        """A learner rank died in the step after self.step: LearnerRecovery rebuilds it at the last
        checkpoint (or the start) and the loop replays the steps after it. Beyond cluster.max_restarts:
        LearnerLost."""
        self.recovery.recover(lambda: self.step, error, self.batches.replayable)

    def _move_to(self, step: int) -> None:  # the loop at a restored checkpoint's step (LoopState.load_state_dict)
        self.step = step

    def evaluate(self) -> dict[str, float]:
        """The held-out evaluation at this step (Evaluator.evaluate), under its phase's deadline. If an engine died
        in it (or was killed stuck), it is restarted and the evaluation made again: seeded, it gives the same."""
        with watchdog.phase("evaluate"):
            try:
                return self.evaluator.evaluate(self.step)
            except ray.exceptions.RayActorError as e:
                if not self.roles.rollout.lost(e):
                    raise  # a learner rank's: the loop's learner recovery
                self.roles.restart_rollout(e, self.step)
                self.batches.relaunch_uncollected()
                return self.evaluator.evaluate(self.step)

    def _final_evaluation(self) -> dict[str, float]:
        after = self.evaluate()
        self.tracker.log(self.step, after | self.health.final(self.step, after), self.cfg.total_steps)
        self.tracker.log_table("eval/samples", self.step, self.evaluator.samples)
        self.evaluator.write("eval_after.json", after)
        figure = plot_run(self.run_dir / "metrics.jsonl", self.run_dir / "pipeline.png")
        self.tracker.log_image("pipeline", self.step, figure)
        return after

    def _stop(self, signal_name: str, saved_at: int | None) -> NoReturn:
        """Checkpoint the completed steps (unless the loop just did), close the tracker, raise Stopped.
        No final evaluation: the resumed run makes it, from the same state, as an uninterrupted one would."""
        if self.step > 0 and saved_at != self.step:
            self.save()
        self.tracker.close()
        checkpoint = self.checkpointer.path(self.step) if self.step > 0 else None
        raise Stopped(signal_name, self.step, self.cfg.total_steps, checkpoint)

    def train_step(self) -> dict[str, float]:
        """One update. With async_training the batch was generated ahead (PromptBatches.next), so
        "generate" times only the wait for it, and the sync returns once the learner has staged its
        weights. The scoring launched ahead computes the rewards and reference logprobs behind the
        generation, so "score" and "reference" then time the wait for them."""
        t: dict[str, float] = {}
        profile = self.step + 1 == self.cfg.logging.profile_step  # logging.profile_step: this step, every role
        r = self.roles
        with watchdog.phase("sync"):  # an elastic pool's engines that left or joined: this policy, then work
            r.change_members(self.step, on_restart=self.batches.relaunch_uncollected)
        with profiled(r.actors(), self.run_dir / "profile", t) if profile else nullcontext(), timed(t, "total"):
            busy_before = r.busy()
            with timed(t, "generate"):
                this = self.batches.next(self.step)
            with timed(t, "score"):  # rewards
                scored = self.score(this.rollouts, this.examples, this.scoring_ahead)
            with timed(t, "reference"):  # the frozen reference policy's logprobs, for the KL
                scored = self.reference(this.rollouts, scored, this.scoring_ahead)
            sampled = Sampled(this.rollouts, this.examples, scored)
            if self.cfg.data.dynamic_sampling:
                with timed(t, "dynamic_sampling"):
                    sampled = self.keep_informative(sampled)
            with timed(t, "score_ahead"):  # the next batch's scoring, launched behind its generation
                self.batches.score_next_ahead()
            batch, scored = sampled.rollouts, sampled.scored
            with r.engines_asleep():  # awake again before the sync
                with timed(t, "advantages"):  # old logprobs, values, KL to the reference, advantages
                    r.learner.experience(batch, scored)
                with timed(t, "update"):  # epochs of mini-batches
                    stats = r.learner.train(self.step)
            limits = self.cfg.algorithm.max_skipped_updates, self.cfg.reward.max_unjudged_steps, self.step
            check_progress(self.state.counters, stats, scored, *limits)
            with timed(t, "sync"):
                r.sync_weights(self.step + 1, self.wait_for_sync, on_restart=self.batches.relaunch_uncollected)
            with watchdog.phase("kl"):
                kl_coef = r.learner.update_kl(stats["kl/ref_seq"], sum(scored.valid))  # per sequence, those trained
        return {
            **batch_metrics(batch, scored),
            **stats,
            **t,
            "kl/coef_next": kl_coef,
            "rollout/engines": len(r.rollout),  # the members at the step's end (one that left in it is gone)
            **r.channel.metrics,  # the sync check's gap and the bytes of the last sync
            **self.state.counts(),
            **batch_staleness(batch, self.step, self.batches.staleness_bound),
            **busy_metrics(t, busy_before, r.busy()),  # the bound in force
            **throughput_metrics(batch, t["timing/total"]),
        }

    def score(self, batch, examples: list[dict], ahead=None):
        """Rewards for training; `ahead`: the batch's scoring launched behind its generation, if any."""
        meta = [self.batches.metadata(e) for e in examples]
        return self.roles.scoring.score(batch, meta, self.cfg.rollout.sampling.temperature, ahead)

    def reference(self, batch, scored, ahead=None):
        """`scored` with the reference policy's logprobs of the batch (launched ahead with its scoring, if so)."""
        ref = self.roles.scoring.reference(batch, self.cfg.rollout.sampling.temperature, ahead)
        return dataclasses.replace(scored, ref_logprobs=ref)

    def keep_informative(self, sampled: Sampled) -> Sampled:
        """Dynamic sampling (orchestrator.loop.dynamic_sampling) with fresh prompts generated and scored."""

        def sample_more(n: int) -> Sampled:
            batch, examples = self.batches.generate(self.step, n)
            return Sampled(batch, examples, self.reference(batch, self.score(batch, examples)))

        d = self.cfg.data
        kept, dropped = dynamic_sample(sampled, d.rollout_batch_size, d.dynamic_sampling_rounds, sample_more)
        self.state.counters["rollout/dropped_groups"] += dropped
        return kept

    def save(self) -> int:
        """Checkpoint this step: the learner, then the loop's state with the batches launched ahead."""

        def loop_state() -> dict:
            self.batches.collect_launched(self.step)
            return self.state.state_dict(self.step) | {"config": to_dict(self.cfg)}

        with watchdog.phase("checkpoint"):
            self.checkpointer.save(self.step, self.roles.learner, loop_state)
        return self.step

    def shutdown(self) -> None:
        self.roles.shutdown()
