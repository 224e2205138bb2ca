"""The training loop: generate -> score -> update -> sync, one named, timed phase each."""

from __future__ import annotations

import dataclasses
import json
import time
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
from orchestrator.loop.parts import LoopParts, start_parts
from orchestrator.loop.profiling import profiled
from orchestrator.loop.recovery import LearnerLost, restored_counters
from orchestrator.loop.signals import Stopped, StopRequest
from orchestrator.loop.step_metrics import (
    batch_metrics,
    busy_metrics,
    check_progress,
    finished_before,
    staleness_metrics,
    timed,
)
from orchestrator.loop.tracking import Tracker
from orchestrator.tools.evaluate import samples_table, summary_table
from orchestrator.tools.plots import plot_run
from runtime import watchdog
from runtime.watchdog import Watchdog, watching

StepHook = Callable[[int, dict], object]  # (step, metrics) after each step; a true return ends training there


class Trainer:
    """Owns the loop: the step (the policy version the engines hold), the counts it checkpoints, the parts
    it drives (LoopParts: the roles, a batch source, the evaluator), a Checkpointer, the Tracker, and what
    a learner recovery goes back to (the last checkpoint, or the loop's state at the start)."""

    def __init__(self, cfg: TrainConfig, parts: LoopParts | None = None):
        self.cfg, self.run_dir = cfg, Path(cfg.run_root) / cfg.name
        self.step, self.last_metrics = 0, {}
        self.learner_rebuilds = 0  # in this process, against cluster.max_restarts (Ray's engine budget is too)
        self.watchdog = Watchdog(cfg.watchdog, self.run_dir, self._actors, self._incident_context)
        with watching(self.watchdog), self.watchdog.phase("start"):
            parts = parts or start_parts(cfg, self.run_dir)
        self.roles, self.batches, self.evaluator = parts.roles, parts.batches, parts.evaluator
        self.wait_for_sync = ahead_bound(cfg) == 0  # asynchronous modes train while the engines take weights
        self.counters = {"data/skipped_lines": parts.skipped_lines, "rollout/dropped_groups": 0}
        self.counters |= {"learner/skipped_updates_in_a_row": 0, "reward/unjudged_steps_in_a_row": 0}
        self.health = Health(cfg.health, self._say, applicable(cfg))
        self.checkpointer = Checkpointer(self.run_dir, cfg.checkpoint.keep_last, cfg.checkpoint.resume)
        with watching(self.watchdog), self.watchdog.phase("start"):
            resumed_at = self._load() if self.checkpointer.resume_from else None
        # what a learner recovery restores: the last checkpoint, or with none, the start (the loop's state
        # kept here as a checkpoint keeps it; the learner's is the model, rebuilt)
        self.last_checkpoint = self.checkpointer.resume_from
        self.initial_state = None if resumed_at is not None else json.dumps(self.loop_state())
        self.finished = finished_before(self.run_dir, resumed_at, cfg.total_steps)
        self.tracker = Tracker(
            cfg.logging, self.run_dir, cfg.name, to_dict(cfg), resumed_at, self.finished, cfg.total_steps
        )

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
        """One step of the loop: train, evaluate held out when due, log, checkpoint when due. Returns the
        step's metrics and the step it checkpointed (None: none)."""
        metrics, saved = self.train_step(), None
        self.step += 1
        every, total = self.cfg.eval.every_n_steps, self.cfg.total_steps
        if every and self.step % every == 0 and self.step < total:
            metrics.update(self.evaluate())
            self.tracker.log_table("eval/samples", self.step, self.evaluator.samples)
        metrics.update(self.health.observe(self.step, metrics))
        self.tracker.log(self.step, metrics, total)
        self.last_metrics = metrics
        every = self.cfg.checkpoint.every_n_steps
        if (every and self.step % every == 0) or self.step == total:
            saved = self.save()
        return metrics, saved

    def recover_learner(self, error: Exception) -> None:
        """A learner rank died (or the watchdog killed a stuck one; `error` says which) in the step after
        self.step: start every rank again, restore the last checkpoint this run saved or resumed from (or
        the run's start) in process, as a resumed run would, and rewind the records to it; the loop then
        replays the lost steps. Beyond cluster.max_restarts rebuilds: LearnerLost (resumable)."""
        while True:
            # this process's rebuilds (a resume starts afresh); the endpoint's episodes cannot be replayed, but a
            # resumed run, whose endpoint starts empty, samples them anew from the restored policy
            if self.learner_rebuilds >= self.cfg.cluster.max_restarts or not self.batches.replayable:
                self.tracker.close()
                replayable = self.batches.replayable
                raise LearnerLost(self.learner_rebuilds, self.step, self.last_checkpoint, error, replayable) from error
            self.learner_rebuilds += 1
            lost_at, start = self.step, time.perf_counter()
            print(
                f"relay: a learner rank died in step {lost_at + 1} ({type(error).__name__}); restarting the "
                f"learner ({self.learner_rebuilds}/{self.cfg.cluster.max_restarts})",
                flush=True,
            )
            try:
                with watchdog.phase("recover"):
                    self.roles.restart_learner()
                    self._restore_last()
            except ray.exceptions.RayActorError as e:
                if self.roles.rollout.lost(e):
                    raise
                error = e  # a new rank died too (its handle may not be the group's yet): again, within the limit
                continue
            took = time.perf_counter() - start
            print(f"relay: learner restored at step {self.step} in {took:.1f}s; going on from there", flush=True)
            return

    def _restore_last(self) -> None:
        """The last checkpoint (or the start) back in the loop, its counts but the restarts, and the
        records (metrics.jsonl, samples.jsonl, wandb) rewound to its step."""
        if self.last_checkpoint is not None:
            state = self.checkpointer.load(self.roles.learner, self.last_checkpoint)
        else:  # the ranks were built anew from the model: the learner is at the start already
            state = json.loads(self.initial_state)
        self._restore(state, restored_counters(self.all_counters(), state["counters"], in_process=True))
        self.tracker.rewind(self.step)

    def evaluate(self) -> dict[str, float]:
        """The held-out evaluation at this step (Evaluator.evaluate), under its phase's deadline. If an
        engine died in it (or the watchdog killed a stuck one), it is restarted with the current weights
        and the evaluation made again: it is seeded and reads only, so it gives what it would have."""
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
            check_progress(self.counters, stats, scored, *limits)
            with timed(t, "sync"):
                r.sync_weights(self.step + 1, self.wait_for_sync, on_restart=self.batches.relaunch_uncollected)
            with watchdog.phase("kl"):
                kl_coef = r.learner.update_kl(stats["kl/ref_seq"], sum(scored.valid))  # per sequence, those trained
        tokens = sum(batch.model_lengths)  # sampled by the model: an episode's observation tokens are not generated
        return {
            **batch_metrics(batch, scored),
            **stats,
            **t,
            "kl/coef_next": kl_coef,
            **self.all_counters(),
            **staleness_metrics(
                batch.version_first,
                self.step,
                self.batches.staleness_bound,
                batch.model_token_versions(),
                batch.version_last,
            ),
            **busy_metrics(t, busy_before, r.busy()),  # the bound in force
            "throughput/tokens_per_s": tokens / t["timing/total"],
            "throughput/samples_per_s": len(batch) / t["timing/total"],
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
        self.counters["rollout/dropped_groups"] += dropped
        return kept

    def all_counters(self) -> dict:
        """Every count the loop reports and checkpoints: its own, the roles' restarts, the batch source's."""
        r = self.roles
        restarts = {"restarts/rollout": r.rollout_restarts, "restarts/scoring": r.scoring.restarts}
        restarts["restarts/learner"] = r.learner_restarts
        return restarts | self.counters | self.batches.counts()

    def save(self) -> int:
        """Checkpoint this step: the learner, then the loop's state with the batches launched ahead."""

        def loop_state() -> dict:
            self.batches.collect_launched(self.step)
            return self.loop_state() | {"config": to_dict(self.cfg)}

        with watchdog.phase("checkpoint"):
            self.last_checkpoint = self.checkpointer.save(self.step, self.roles.learner, loop_state)
        return self.step

    def loop_state(self) -> dict:
        """The loop's state as a checkpoint keeps it: the step, the counts, the scoring state, the sampler
        and the batches launched ahead (collected: PromptBatches.collect_launched)."""
        counts, scoring = self.all_counters(), self.roles.scoring.state_dict()
        health = self.health.state_dict()
        return {"step": self.step, "counters": counts, "scoring": scoring, "health": health} | self.batches.state_dict()

    def _load(self) -> int:
        """Restore the checkpoint to resume from; returns its step."""
        state = self.checkpointer.load(self.roles.learner, self.checkpointer.resume_from)
        self._restore(state, restored_counters(self.all_counters(), state["counters"], in_process=False))
        print(f"relay: resumed from {self.checkpointer.resume_from} at step {self.step}", flush=True)
        return self.step

    def _restore(self, state: dict, counts: dict) -> None:
        """A checkpoint's loop `state` back (the learner restored already), with the counts `counts`, and
        the restored learner's weights to the engines (fresh ones hold the initial model, live ones a later
        policy)."""
        self.roles.scoring.load_state_dict(state["scoring"])
        self.step = state["step"]
        self.counters |= {k: counts[k] for k in self.counters}
        self.roles.rollout_restarts = counts["restarts/rollout"]
        self.roles.scoring.restarts = counts["restarts/scoring"]
        self.roles.learner_restarts = counts["restarts/learner"]
        self.batches.load_state_dict(state, counts)
        self.health.load_state_dict(state.get("health"))  # none in a checkpoint from before health existed
        self.roles.channel.send(self.step)

    def _say(self, line: str) -> None:
        """A line for the user: the terminal, and the run folder's relay.log."""
        print(line, flush=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with (self.run_dir / "relay.log").open("a") as log:
            log.write(line + "\n")

    def _actors(self) -> dict:
        """Every role's actor by name, for the watchdog (none while the roles start)."""
        return self.roles.actors() if hasattr(self, "roles") else {}

    def _incident_context(self) -> dict:
        return {"step": self.step, "last_metrics": self.last_metrics, "config": to_dict(self.cfg)}

    def shutdown(self) -> None:
        self.roles.shutdown()
