"""Held-out evaluation during training: before the first step, every eval.every_n_steps, after the
last; the sample table beside the reference policy's answers, and the eval files in the run folder."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from orchestrator.config.schema import TrainConfig
from orchestrator.data.prompts import policy_prompt, reward_metadata
from orchestrator.tools.eval_report import sample_rows, shown
from orchestrator.tools.evaluate import eval_ks, eval_sampling, evaluate_policy, evaluate_suites
from rollout.types import RolloutBatch
from runtime.seeds import EVALUATION


class Evaluator:
    """Owns the held-out prompts, the reference policy's answers to the first of them (step 0's, kept
    in eval_reference_samples.json), the latest sample table, and the run's eval_before/eval_after
    files. Generates on the rollout pool, scores read-only on the scoring pool, and reads the KL side
    from the learner's logprobs."""

    def __init__(
        self, cfg: TrainConfig, held_out: list[dict], run_dir: Path, rollout, scoring, learner, suites: list = ()
    ):
        """suites: the evaluation suites (orchestrator/tools/suites.py), evaluated with the held-out set."""
        self.cfg, self.run_dir, self.suites = cfg, run_dir, list(suites)
        self.rollout, self.scoring, self.learner = rollout, scoring, learner
        template = cfg.data.apply_chat_template
        self.prompts = [policy_prompt(e["prompt"], template) for e in held_out]
        self.metadata = [reward_metadata(e, template) for e in held_out]
        self.reference_samples: dict[str, tuple] = {}  # str(prompt index) -> (answer, reward) at step 0
        self.samples: list[dict] = []  # the latest evaluation's table rows
        self.before: dict[str, float] = {}  # the metrics before training
        self.said: set[str] = set()  # the evaluation's notes already printed: each once a run

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out prompts through orchestrator.tools.evaluate (read-only scoring, raw rewards); the table
        of the first prompts is kept in `samples`."""
        sampling = eval_sampling(self.cfg)
        ev = evaluate_policy(
            lambda p, greedy: self.rollout.generate(p, 0, greedy, sampling, self.metadata, EVALUATION),
            self.score,
            self.prompts,
            self.metadata,
            self.cfg.eval.greedy,
            sampling.temperature,
            self.learner.policy_logprobs,
            eval_ks(self.cfg),
        )
        self.samples = self._sample_table(step, *shown(ev))
        suites, notes = evaluate_suites(
            self.suites,
            lambda p, greedy, meta: self.rollout.generate(p, 0, greedy, sampling, meta, EVALUATION),
            self.score,
            self.cfg,
            self.learner.policy_logprobs,
        )
        for note in ev.notes + notes:  # a figure left out is said, not silently missing
            if note not in self.said:
                self.said.add(note)
                print(f"relay: held-out evaluation: {note}", flush=True)
        return ev.metrics | suites

    def score(self, batch: RolloutBatch, meta: list[dict], temperature: float, with_reference: bool, suite: str = ""):
        """Read-only scoring (ScoringService.evaluate); the reference's logprobs from the learner where it
        computes them (a LoRA policy's base: learner.lora.reference learner)."""
        in_learner = with_reference and self.cfg.learner.lora.reference_in_learner
        scored = self.scoring.evaluate(batch, meta, temperature, with_reference and not in_learner, suite)
        if in_learner:
            scored = dataclasses.replace(scored, ref_logprobs=self.learner.policy_logprobs(batch, reference=True))
        return scored

    def _sample_table(self, step: int, greedy: RolloutBatch, scored) -> list[dict]:
        """The first held-out prompts, the current policy's greedy answer beside the reference
        policy's. The reference answer is the step-0 one: at step 0 the policy is the reference
        (unless reward.reference_model_path names another model). Keyed by the prompt's index (JSON
        keys are strings); with sampled answers (eval.greedy off), the first sample of each prompt."""
        rows = sample_rows(self.prompts, greedy, scored, self.cfg.eval.num_samples_to_log)
        if step == 0:
            self.reference_samples = {}
            for r in rows:
                self.reference_samples.setdefault(str(r["index"]), (r["policy"], r["reward"]))
            self.write("eval_reference_samples.json", self.reference_samples)
        for r in rows:
            r["reference"], r["reference_reward"] = self.reference_samples.get(str(r["index"]), (None, None))
        return rows

    def evaluate_before(self, step: int) -> dict[str, float]:
        """The metrics before training: evaluated at step 0 (an earlier run's eval_after.json of this
        name removed), read back from the run folder when resumed (with the reference answers)."""
        if step == 0:
            (self.run_dir / "eval_after.json").unlink(missing_ok=True)
            self.before = self.evaluate(step)
            self.write("eval_before.json", self.before)
        else:
            self.before = json.loads((self.run_dir / "eval_before.json").read_text())
            saved = self.run_dir / "eval_reference_samples.json"
            self.reference_samples = json.loads(saved.read_text()) if saved.exists() else {}  # else: no column
        return self.before

    def read_after(self) -> dict[str, float]:
        """A resumed run that had finished: the final evaluation it wrote."""
        return json.loads((self.run_dir / "eval_after.json").read_text())

    def write(self, name: str, data: dict) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / name).write_text(json.dumps(data, indent=1))
