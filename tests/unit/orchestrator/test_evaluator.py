"""The trainer's held-out evaluation (orchestrator/loop/evaluator.py): its sample table beside the reference
policy's answers, and what it says about figures it leaves out."""

from pathlib import Path

import pytest

from orchestrator.config.load import load_config
from orchestrator.loop.evaluator import Evaluator
from orchestrator.tools.evaluate import NO_VOTE
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch
from tests.small_loop import DEFAULT, Learner

PREAMBLE = "You are a careful calculator. Think step by step, then give the sum alone. "  # > 60 characters


class Engines:
    """The rollout pool at one policy: it answers each prompt `<tag> <the prompt's last 4 characters>`."""

    def __init__(self, tag: str = "reference"):
        self.tag = tag

    def generate(self, prompts, step, greedy=False, sampling=None, tasks=None, draw=0) -> RolloutBatch:
        n = 1 if greedy else sampling.n_samples_per_prompt
        texts = [f"{self.tag} {p[-4:]}" for p in prompts for _ in range(n)]
        rows = [j for j in range(len(prompts)) for _ in range(n)]
        return RolloutBatch(
            rows, [[1]] * len(rows), [[2]] * len(rows), [[0.0]] * len(rows), texts, ["stop"] * len(rows)
        )


class Scoring:
    """Scores every answer 1 under `source` (the component the evaluation reads pass@k and maj@k from)."""

    def __init__(self, source: str = "math_answer"):
        self.source, self.asked = source, []

    def evaluate(self, batch, metadata, temperature, with_reference, suite="") -> ScoredBatch:
        n = len(batch)
        self.asked.append(with_reference)
        ref = [[0.0]] * n if with_reference else [[]] * n  # its own reference: logprob 0 a token
        return ScoredBatch([1.0] * n, {self.source: [1.0] * n}, [True] * n, [False] * n, ref, raw=[1.0] * n)


def evaluator(tmp_path: Path, engines, scoring, over=()) -> Evaluator:
    cfg = load_config(DEFAULT, [f"run_root={tmp_path}", "name=run", "logging.wandb.mode=disabled", *over])
    held_out = [{"prompt": f"{PREAMBLE}{i}+{i}=", "answer": str(2 * i), "metadata": {}} for i in range(3)]
    return Evaluator(cfg, held_out, tmp_path / "run", engines, scoring, Learner([]))


def test_the_sample_table_pairs_each_prompt_with_its_own_reference_answer(tmp_path):
    """Issue 40, item 9: rows were keyed by the prompt's first 60 characters, so prompts sharing them all
    showed the last one's reference answer."""
    engines = Engines("reference")
    ev = evaluator(tmp_path, engines, Scoring())
    ev.evaluate_before(0)
    engines.tag = "policy"
    ev.evaluate(5)
    pairs = [(r["reference"], r["policy"]) for r in ev.samples]
    assert pairs == [
        ("reference 0+0=", "policy 0+0="),
        ("reference 1+1=", "policy 1+1="),
        ("reference 2+2=", "policy 2+2="),
    ]
    assert len({r["prompt"] for r in ev.samples}) == 1  # the display cut stays: the rows differ past it
    # a resumed run reads the step-0 answers back from the run folder and pairs them the same way
    resumed = evaluator(tmp_path, Engines("policy"), Scoring())
    resumed.evaluate_before(5)
    resumed.evaluate(6)
    assert [(r["reference"], r["policy"]) for r in resumed.samples] == pairs


def test_a_figure_the_evaluation_cannot_give_is_said_once_in_the_log(tmp_path, capsys):
    """Issue 40, item 4: an environment's episodes have no answer to vote on: no maj@k, and the log says why."""
    ev = evaluator(tmp_path, Engines(), Scoring("environment"))
    metrics = ev.evaluate_before(0) | ev.evaluate(3)
    assert "eval/sampled/pass@8" in metrics and not any("maj@" in k for k in metrics)
    said = [line for line in capsys.readouterr().out.splitlines() if "maj@k" in line]
    assert said == [f"relay: held-out evaluation: no maj@k: the environment source's {NO_VOTE['environment']}"]


def test_under_lora_the_held_out_kl_is_to_the_learners_base_not_a_scoring_copy(tmp_path):
    """Issue 43, item 3: learner.lora.reference learner (LoRA's default) takes the reference's logprobs from the
    learner (its adapter off: -0.8 a token here), not from the scoring service (0 here); scoring keeps them
    otherwise. The policy's are -0.5 a token."""
    lora = evaluator(tmp_path / "a", Engines(), scoring := Scoring(), ["learner.lora.rank=4"])
    assert lora.evaluate(0)["eval/sampled/kl_ref"] == pytest.approx(-0.5 - -0.8)
    assert scoring.asked == [False, False]  # greedy answers and samples: the scoring service computes none
    on_scoring = ["learner.lora.rank=4", "learner.lora.reference=scoring"]
    for over in ([], on_scoring):
        ev = evaluator(tmp_path / str(len(over)), Engines(), scoring := Scoring(), over)
        assert ev.evaluate(0)["eval/sampled/kl_ref"] == pytest.approx(-0.5 - 0.0)
        assert scoring.asked == [False, True]


def test_reference_logprobs_that_do_not_cover_the_samples_fail_rather_than_read_a_kl_of_0(tmp_path):
    class NoReference(Scoring):
        def evaluate(self, batch, metadata, temperature, with_reference, suite="") -> ScoredBatch:
            return super().evaluate(batch, metadata, temperature, False, suite)  # empty rows, as if none were asked

    with pytest.raises(ValueError, match="reference's logprobs do not cover the samples' tokens"):
        evaluator(tmp_path, Engines(), NoReference()).evaluate(0)
