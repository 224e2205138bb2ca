"""The training loop: generate -> score -> update -> sync, one named, timed call per phase."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections import deque
from contextlib import nullcontext
from pathlib import Path
from typing import NoReturn

import ray

from learner.checkpoint import publish
from learner.group import LearnerGroup
from orchestrator.agents import endpoint_batch, start_gateway
from orchestrator.builtin_models import resolve_model_path
from orchestrator.config import AsyncMode, TrainConfig
from orchestrator.data import PromptSampler, load_split, policy_prompt, reward_metadata
from orchestrator.evaluate import evaluate_policy, sample_rows, samples_table, shown, summary_table
from orchestrator.load_config import to_dict
from orchestrator.phases import (
    Ahead,
    batch_metrics,
    busy_metrics,
    check_progress,
    checkpoints,
    finished_before,
    informative,
    offset,
    pick_groups,
    resume_path,
    staleness_metrics,
    timed,
)
from orchestrator.placement import cpu_threads, placement, unit
from orchestrator.plots import plot_run
from orchestrator.profiling import profiled
from orchestrator.signals import Stopped, StopRequest
from orchestrator.tracking import Tracker
from reward_service.pool import ScoringPool
from rollout.channel import WeightChannel
from rollout.pool import PoolOptions, RolloutPool
from rollout.types import RolloutBatch
from runtime.actors import await_ready
from runtime.device import malloc_env
from runtime.logprobs import SamplerSettings
from runtime.seeds import EVALUATION

log = logging.getLogger(__name__)


def learner_algorithm(cfg: TrainConfig):
    """The algorithm section the learner runs: loss_norm_tokens 0 resolved to the budget of the
    longest sample this run can make (seq_sum_norm's constant): one response, an episode's model
    and observation tokens, or an endpoint conversation (at most rollout.max_model_len)."""
    a, r = cfg.algorithm, cfg.rollout
    budget = r.max_model_len if r.endpoint.enabled else cfg.env.response_tokens(r.sampling.max_new_tokens)
    return dataclasses.replace(a, loss_norm_tokens=a.loss_norm_tokens or budget)


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_root) / cfg.name
        self.train, self.held_out, self.skipped_lines = load_split(cfg.data, cfg.seed)  # bad data fails first
        self.model_path = resolve_model_path(cfg.learner.model_path, cfg.run_root)
        self.sampler = PromptSampler(len(self.train), cfg.seed, cfg.data.shuffle)
        self.step = 0  # also the policy version the engines hold: weight syncs since the initial model
        self.counters = {
            "restarts/rollout": 0,
            "restarts/scoring": 0,
            "data/skipped_lines": self.skipped_lines,
            "rollout/dropped_groups": 0,
            "learner/skipped_updates_in_a_row": 0,
            "async/dropped_stale": 0,
            "reward/unjudged_steps_in_a_row": 0,
        }
        # async_training: batches whose generation runs ahead of the learner, at most `lead` of them
        # beyond the one being trained (so a sample trains at most `lead` versions after its own)
        a = cfg.async_training
        self.lead = {AsyncMode.sync: 0, AsyncMode.one_step: 1, AsyncMode.full: a.max_staleness}[a.mode]
        self.ahead: deque[Ahead] = deque()
        if not ray.is_initialized():
            ray.init(address=cfg.cluster.address or None, include_dashboard=False, log_to_driver=False)
        self._start_roles()
        resume_from = resume_path(cfg.checkpoint.resume, self.run_dir / "checkpoints")
        if resume_from:
            self._load(resume_from)
        self.finished = finished_before(self.run_dir, self.step if resume_from else None, cfg.total_steps)
        self.tracker = Tracker(
            cfg.logging,
            self.run_dir,
            cfg.name,
            to_dict(cfg),
            resumed_at=self.step if resume_from else None,
            finished=self.finished,
        )

    # ------------------------------------------------------------------ setup
    def _start_roles(self) -> None:
        c, cpus = self.cfg.cluster, (0 if self.cfg.cluster.colocate else 1)
        self.pg, place = placement(c)
        free = place is None  # no bundles: the actors ask for their role's custom resource themselves
        # engines and learner on the same GPUs: vLLM sleeps during the update (sleep_engines)
        self.sleep_engines = c.colocate and c.gpus_per_rollout_worker > 0 and c.gpus_per_learner > 0
        rollout_threads, learner_threads, scoring_threads = cpu_threads(self.cfg)
        self.rollout = RolloutPool(
            dataclasses.replace(self.cfg.rollout, cpu_threads=rollout_threads),
            self.model_path,
            c.rollout_workers,
            self.cfg.seed,
            PoolOptions(
                num_cpus=cpus,
                num_gpus=c.gpus_per_rollout_worker,
                max_restarts=c.max_restarts,
                sleep_mode=self.sleep_engines,
                scheduling=place[: c.rollout_workers] if place else None,
                resources=unit(c.rollout_resource) if free else None,
                step_samples=self.cfg.data.rollout_batch_size * self.cfg.rollout.sampling.n_samples_per_prompt,
                keep_freed_memory=c.cpu_keep_freed_memory,
            ),
            env=self.cfg.env,
        )
        self.scoring = ScoringPool(
            self.cfg.reward,
            self.model_path,
            self.cfg.learner.dtype.value,
            scoring_threads,
            self.cfg.learner.logprob_chunk_tokens,
            dict(
                num_cpus=cpus,
                num_gpus=c.gpus_per_scoring,
                max_restarts=c.max_restarts,
                resources=unit(c.scoring_resource) if free else {},
                runtime_env={"env_vars": malloc_env(c.cpu_keep_freed_memory, c.gpus_per_scoring > 0, threaded=True)},
                **({"scheduling_strategy": place[-1]} if place else {}),
            ),
        )
        learner_cfg = dataclasses.replace(self.cfg.learner, model_path=self.model_path, threads=learner_threads)
        self.learner = LearnerGroup(
            learner_cfg,
            learner_algorithm(self.cfg),
            SamplerSettings.of(self.cfg.rollout.sampling),
            c.learner_ranks,
            self.cfg.seed,
            num_cpus=cpus,
            num_gpus=c.gpus_per_learner,
            scheduling=place[c.rollout_workers : -1] if place else None,
            resources=unit(c.learner_resource) if free else None,
            keep_freed_memory=c.cpu_keep_freed_memory,
        )
        self.channel = WeightChannel(self.rollout, self.learner, self.cfg.rollout.sync_bucket_mb)
        self.gateway = (
            start_gateway(self.rollout.workers, self.model_path, self.cfg.rollout) if self.endpoint.enabled else None
        )

    # ------------------------------------------------------------------ the loop
    def run(self, stop: StopRequest | None = None) -> dict:
        """Train to total_steps, then evaluate on the held-out prompts. A stop request (a signal, see
        orchestrator.signals) is read between steps: the step in flight finishes (steps take seconds
        to minutes; abandoning one would redo it anyway), then _stop checkpoints and raises Stopped."""
        stop = stop or StopRequest()
        if self.step == 0:
            (self.run_dir / "eval_after.json").unlink(missing_ok=True)  # an earlier run's of this name
            self.before = self.evaluate()
            self._write_json("eval_before.json", self.before)
            self.tracker.log_table("eval/samples", 0, self.samples)
        else:
            self.before = json.loads((self.run_dir / "eval_before.json").read_text())
            saved = self.run_dir / "eval_reference_samples.json"
            self.reference_samples = (
                json.loads(saved.read_text()) if saved.exists() else {}
            )  # else: no reference column
        saved_at = None  # the step this process last checkpointed
        while self.step < self.cfg.total_steps and not stop.requested:
            metrics = self.train_step()
            self.step += 1
            if (
                self.cfg.eval.every_n_steps
                and self.step % self.cfg.eval.every_n_steps == 0
                and self.step < self.cfg.total_steps
            ):
                metrics.update(self.evaluate())
                self.tracker.log_table("eval/samples", self.step, self.samples)
            self.tracker.log(self.step, metrics, self.cfg.total_steps)
            every = self.cfg.checkpoint.every_n_steps
            if (every and self.step % every == 0) or self.step == self.cfg.total_steps:
                self.save()
                saved_at = self.step
        if stop.requested:
            self._stop(stop.signal, saved_at)
        self.channel.settle()
        if self.finished:  # resumed after its final evaluation (eval_after.json): rows, table and figure are logged
            after = json.loads((self.run_dir / "eval_after.json").read_text())
        else:
            after = self.evaluate()
            self.tracker.log(self.step, after, self.cfg.total_steps)
            self.tracker.log_table("eval/samples", self.step, self.samples)
            self._write_json("eval_after.json", after)
            figure = plot_run(self.run_dir / "metrics.jsonl", self.run_dir / "pipeline.png")
            self.tracker.log_image("pipeline", self.step, figure)
        print(summary_table(self.before, after), flush=True)
        if not self.finished:
            print(samples_table(self.samples), flush=True)
        self.tracker.close()
        return after

    def _stop(self, signal_name: str, saved_at: int | None) -> NoReturn:
        """Keep the completed steps in a checkpoint (unless the loop just wrote this step's), close the
        tracker and raise Stopped (the CLI reports it). No evaluation after training: the run has not
        finished; the resumed one evaluates, from the same state, as an uninterrupted run would."""
        if self.step > 0 and saved_at != self.step:
            self.save()
        checkpoint = self.run_dir / "checkpoints" / f"step_{self.step}" if self.step > 0 else None
        self.tracker.close()
        raise Stopped(signal_name, self.step, self.cfg.total_steps, checkpoint)

    def train_step(self) -> dict[str, float]:
        """One update. With async_training the batch was generated ahead (next_batch), so "generate"
        times only the wait for it, and the sync returns once the learner has staged its weights."""
        t: dict[str, float] = {}
        profile = self.step + 1 == self.cfg.logging.profile_step  # logging.profile_step: this step, every role
        busy_before = self._busy()
        with profiled(self.roles(), self.run_dir / "profile", t) if profile else nullcontext(), timed(t, "total"):
            with timed(t, "generate"):
                batch, examples, judged = self.next_batch()
            with timed(t, "score"):
                scored = self.score(batch, examples, judged)
            if self.cfg.data.dynamic_sampling:
                with timed(t, "dynamic_sampling"):
                    batch, examples, scored = self.keep_informative(batch, examples, scored)
            self._judge_next()
            with timed(t, "update"), self.rollout.asleep(self.sleep_engines):  # awake again before the sync
                stats = self.learner.update(batch, scored, self.step)
            self.check_progress(stats, scored)
            with timed(t, "sync"):
                self.push(self.step + 1)
            kl_coef = self.learner.update_kl(stats["kl/ref_seq"], sum(scored.valid))  # per sequence, those trained
        tokens = sum(batch.model_lengths)  # sampled by the model: an episode's observation tokens are not generated
        self.counters["restarts/scoring"] = self.scoring.restarts
        return {
            **batch_metrics(batch, scored),
            **stats,
            **t,
            "kl/coef_next": kl_coef,
            **self.counters,
            **staleness_metrics(
                batch.version_first, self.step, self.endpoint.max_staleness if self.gateway else self.lead
            ),
            **busy_metrics(t, busy_before, self._busy()),  # the bound in force
            "throughput/tokens_per_s": tokens / t["timing/total"],
            "throughput/samples_per_s": len(batch) / t["timing/total"],
        }

    def _busy(self) -> dict[str, list[float]]:
        return {"rollout": self.rollout.busy_seconds(), "scoring": [self.scoring.busy_seconds()]}

    def next_batch(self) -> tuple[RolloutBatch, list[dict], object]:
        """This step's batch, and its scoring if launched ahead. Generation is launched `lead` steps
        ahead first (the engines take each weight sync after the batches queued before it), so the
        batch of step s comes from policy version s - lead at the oldest; a batch older than that
        (only possible if the pipeline was disturbed) is dropped, counted and generated again from
        the same prompts."""
        if self.gateway is not None:  # an agent program's finished episodes, not data prompts
            batch, examples, counts = endpoint_batch(
                self.gateway, self.cfg.data.rollout_batch_size, self.endpoint.wait_timeout_s, self.step
            )
            self.counters.update(counts)
            return batch, examples, None
        while len(self.ahead) <= self.lead and self.step + len(self.ahead) < self.cfg.total_steps:
            self.ahead.append(self._launch(self.step + len(self.ahead), self.cfg.data.rollout_batch_size))
        first = self.ahead.popleft()
        batch, examples = self.generate(first=first)
        return (
            batch,
            examples,
            first.judged if len(examples) == len(first.indices) else None,
        )  # else topped up: scored whole

    def roles(self) -> dict:
        """Every actor by role name (rollout_i, scoring, learner_i)."""
        return (
            {f"rollout_{i}": w for i, w in enumerate(self.rollout.workers)}
            | {"scoring": self.scoring.actor}
            | {f"learner_{i}": r for i, r in enumerate(self.learner.ranks)}
        )

    @property
    def endpoint(self):
        return self.cfg.rollout.endpoint

    @property
    def _temperature(self) -> float:
        return self.cfg.rollout.sampling.temperature

    def score(self, batch: RolloutBatch, examples: list[dict], judged=None):
        meta = [self._meta(e) for e in examples]
        return self.scoring.score(batch, meta, self._temperature, judged)

    def keep_informative(self, batch: RolloutBatch, examples: list[dict], scored):
        """Dynamic sampling (DAPO): groups whose rewards are all equal teach GRPO nothing; replace
        them with fresh prompts, for up to dynamic_sampling_rounds extra rounds. If still short,
        equal groups fill the rest, so the batch keeps its shape."""
        want, groups, skipped, calls = self.cfg.data.rollout_batch_size, [], list(batch.skipped), [scored]
        for round_ in range(self.cfg.data.dynamic_sampling_rounds + 1):
            for j, example in enumerate(examples):
                rows = [i for i, p in enumerate(batch.prompt_index) if p == j]
                if rows:
                    kept = scored.select(rows)
                    groups.append((batch.select(rows), kept, example, informative(kept.rewards, kept.valid)))
            if sum(g[3] for g in groups) >= want or round_ == self.cfg.data.dynamic_sampling_rounds:
                break
            batch, examples = self.generate(want - sum(g[3] for g in groups))
            scored = self.score(batch, examples)
            skipped, calls = skipped + batch.skipped, calls + [scored]
        chosen, dropped = pick_groups(groups, want)
        self.counters["rollout/dropped_groups"] += dropped
        for j, (b, _, _, _) in enumerate(chosen):
            b.prompt_index = [j] * len(b)
        merged = RolloutBatch.concat([b for b, _, _, _ in chosen])
        merged.skipped = skipped
        return merged, [e for _, _, e, _ in chosen], type(scored).concat([s for _, s, _, _ in chosen], calls)

    def generate(self, want: int | None = None, first: Ahead | None = None) -> tuple[RolloutBatch, list[dict]]:
        """`want` (default rollout_batch_size) prompts' samples, starting from `first` (launched
        ahead) if given; prompts the engine skips are replaced (topped up), so every step trains on
        the configured batch shape."""
        want, parts, examples = want or self.cfg.data.rollout_batch_size, [], []
        for round_ in range(5):
            need = want - sum(len(set(p.prompt_index)) for p in parts)
            if need == 0:
                break
            job = first if round_ == 0 and first is not None else self._launch(self.step, need)
            parts.append(offset(self._collect(job), len(examples)))
            examples += [self.train[i] for i in job.indices]
        batch = RolloutBatch.concat(parts)
        if len(set(batch.prompt_index)) != want:
            raise RuntimeError(
                f"step {self.step}: could not fill a batch of {want} usable prompts; see the skipped-prompt log"
            )
        return batch, examples

    def _launch(self, step: int, n: int) -> Ahead:
        """Launch the next n prompts, seeded by (step, draw): a top-up or dynamic-sampling round has its own."""
        return self._resubmit(Ahead(step, self.sampler.next(n), None, draw=self.sampler.drawn))

    def _collect(self, job: Ahead) -> RolloutBatch:
        """The job's samples. If an engine died, wait for Ray to restart it, give it the current weights
        and generate every uncollected batch again from its prompts: nothing collected is lost or
        repeated. A batch beyond the staleness bound is generated again likewise."""
        if job.batch is None:
            try:
                job.batch = self.rollout.collect(job.pending)
            except ray.exceptions.RayActorError as e:
                self._restart_rollout(e, self.step, [job])
                job.batch = self.rollout.collect(job.pending)
        if any(self.step - v > self.lead for v in job.batch.version_first):
            self.counters["async/dropped_stale"] += len(job.batch)
            job.batch = None
            self._resubmit(job)
            return self._collect(job)
        return job.batch

    def push(self, version: int) -> None:
        """Weights to the engines as policy `version`; asynchronous modes do not wait for the engines."""
        try:
            self.channel.push(version, wait=self.lead == 0)
        except ray.exceptions.RayActorError as e:
            self._restart_rollout(e, version, [])

    def _restart_rollout(self, error: Exception, version: int, jobs: list[Ahead]) -> None:
        """An engine died: wait for Ray to restart it, rebuild the weight-sync group, give every engine
        the learner's weights (policy `version`) and launch every uncollected batch again."""
        self.counters["restarts/rollout"] += 1
        log.warning("rollout worker died (%s); waiting for its restart and generating again", type(error).__name__)
        await_ready(self.rollout.workers)
        self.channel.connect()
        self.channel.push(version)
        for job in [*jobs, *self.ahead]:
            if job.batch is None:
                self._resubmit(job)

    def _resubmit(self, job: Ahead) -> Ahead:
        """(Re)launch the job's generation from its prompts and tasks (what an environment resets on)."""
        examples = [self.train[i] for i in job.indices]
        job.pending, job.judged = (
            self.rollout.submit(
                [self._prompt(e) for e in examples], job.step, draw=job.draw, tasks=[self._meta(e) for e in examples]
            ),
            None,
        )
        return job

    def _judge_next(self) -> None:
        """Asynchronous modes: launch the next batch's scoring behind its generation, so it runs as soon
        as the batch is generated, on time the engines' side would wait, while the learner trains on
        this one; the learner's side keeps only the update. Only the next batch, and only after this
        step's scoring calls: the service runs its calls in order, so none may queue behind a
        generation further ahead."""
        job = self.ahead[0] if self.ahead else None
        if job is not None and job.judged is None:
            parts = job.pending if job.batch is None else [job.batch]
            job.judged = self.scoring.judge_ahead(
                parts, [self._meta(self.train[i]) for i in job.indices], self._temperature
            )

    def check_progress(self, stats: dict[str, float], scored) -> None:  # stop a run that cannot learn
        check_progress(
            self.counters,
            stats,
            scored,
            self.cfg.algorithm.max_skipped_updates,
            self.cfg.reward.max_unjudged_steps,
            self.step,
        )

    def _prompt(self, example: dict):
        return policy_prompt(example["prompt"], self.cfg.data.apply_chat_template)

    def _meta(self, example: dict) -> dict:
        return reward_metadata(example, self.cfg.data.apply_chat_template)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Held-out prompts through orchestrator.evaluate (read-only scoring, raw rewards)."""
        prompts = [self._prompt(e) for e in self.held_out]
        meta = [self._meta(e) for e in self.held_out]
        ev = evaluate_policy(
            lambda p, greedy: self.rollout.generate(p, 0, greedy, tasks=meta, draw=EVALUATION),
            self.scoring.evaluate,
            prompts,
            meta,
            self.cfg.eval.greedy,
            self._temperature,
            self.learner.policy_logprobs,
        )
        self.samples = self._sample_table(prompts, *shown(ev))
        return ev.metrics

    def _sample_table(self, prompts: list, greedy: RolloutBatch, scored) -> list[dict]:
        """The first held-out prompts, the current policy's greedy answer beside the reference
        policy's. The reference answer is the step-0 one: at step 0 the policy is the reference
        (unless reward.reference_model_path names another model)."""
        rows = sample_rows(prompts, greedy, scored, self.cfg.eval.num_samples_to_log)
        if self.step == 0:
            self.reference_samples = {r["prompt"]: (r["policy"], r["reward"]) for r in rows}
            self._write_json("eval_reference_samples.json", self.reference_samples)
        for r in rows:
            r["reference"], r["reference_reward"] = self.reference_samples.get(r["prompt"], (None, None))
        return rows

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """runs/<name>/checkpoints/step_N, written as step_N.tmp, then published (learner.checkpoint.publish:
        a step_N already there is replaced only once the new one is complete)."""
        root = self.run_dir / "checkpoints"
        final, tmp = root / f"step_{self.step}", root / f"step_{self.step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.learner.save(tmp / "learner")
        state = {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "counters": self.counters,
            "scoring": self.scoring.state_dict(),
            "config": to_dict(self.cfg),
            "ahead": [job.state_dict() for job in self.ahead if self._collect(job)],
        }  # generated ahead: kept as they are
        (tmp / "orchestrator.json").write_text(json.dumps(state))
        publish(tmp, final)
        for old in checkpoints(root)[: -self.cfg.checkpoint.keep_last]:
            shutil.rmtree(old[1])
        return final

    def _load(self, path: Path) -> None:
        state = json.loads((path / "orchestrator.json").read_text())
        self.learner.load(path / "learner")
        self.scoring.load_state_dict(state["scoring"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = state["step"]
        self.counters.update(state["counters"])
        self.scoring.restarts = self.counters["restarts/scoring"]
        self.ahead = deque(Ahead.from_state(a) for a in state["ahead"])
        self.channel.push(self.step)  # the engines start from the initial model: give them the restored one
        print(f"relay: resumed from {path} at step {self.step}", flush=True)

    def _write_json(self, name: str, data: dict) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / name).write_text(json.dumps(data, indent=1))

    def shutdown(self) -> None:
        if self.gateway is not None:
            ray.get(self.gateway.shutdown.remote())
        self.rollout.shutdown()
        self.learner.shutdown()
        self.scoring.shutdown()
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
