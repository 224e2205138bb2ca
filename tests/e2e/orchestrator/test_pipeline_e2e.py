"""The three RLHF stages end to end on the real stack, test-sized: SFT from scratch -> RM -> PPO (the
preset's: clipped loss, RLOO baseline) with the RM as reward, then `relay eval` against the SFT reference
and `relay plot`."""

import json
import random

import pytest

from orchestrator.config.load import load_config
from orchestrator.config.schema import PipelineConfig
from tests.helpers import REPO
from tests.helpers import jsonl_rows as rows

pytestmark = pytest.mark.e2e
SFT_ACCURACY = 0.3  # held-out greedy accuracy the from-scratch SFT must reach
RM_ACCURACY = 0.65  # held-out pairwise accuracy of the reward model


@pytest.fixture(scope="module")
def pipeline(ray_cluster, tmp_path_factory):
    from orchestrator.stages.pipeline import run_pipeline

    root = tmp_path_factory.mktemp("pipeline")
    cfg = load_config(
        REPO / "configs" / "pipeline_tiny_cpu.yaml",
        [
            # SFT at the preset's 1200 steps: at 600 this machine's run (2026-12-01) stopped at loss 0.73 and 12.5%
            # greedy accuracy, answers off by a few (the same numbers on the code before that day's changes)
            f"run_root={root}",
            "name=p",
            "sft.train.steps=1200",
            "sft.train.eval_every=600",
            # the preset's RM learns the SFT model's own mistakes, which takes it 2,400 steps (docs/rlhf_pipeline.md);
            # test-sized, corrupted answers (300 steps); tests/unit/orchestrator/test_stage_data.py checks the samples
            "rm.data.rejected_from=corrupt",
            "rm.train.steps=300",
            "rm.train.eval_every=150",
            "ppo.total_steps=40",
            "ppo.data.eval_size=64",
            "ppo.logging.progress_bar=false",
        ],
        root=PipelineConfig,
    )
    run_pipeline(cfg)
    return root / "p"


def test_sft_from_scratch_lowers_held_out_loss_and_learns_the_task(pipeline):
    summary = json.loads((pipeline / "sft" / "model" / "relay_sft.json").read_text())
    assert summary["after"]["eval/loss"] < 0.5 * summary["before"]["eval/loss"]
    assert summary["after"]["eval/greedy_accuracy"] >= SFT_ACCURACY, summary
    assert (pipeline / "sft" / "init" / "tokenizer.json").exists()  # built from config, not downloaded
    assert len([r for r in rows(pipeline / "sft" / "metrics.jsonl") if "train/loss" in r]) == 1200


def test_reward_model_ranks_held_out_pairs_and_stores_its_stats(pipeline):
    stats = json.loads((pipeline / "rm" / "model" / "relay_reward_stats.json").read_text())
    assert stats["after"]["eval/pairwise_accuracy"] >= RM_ACCURACY, stats
    assert stats["std"] > 0
    # loads as a reward source, normalised by those stats: held-out scores centre near 0
    from reward_service.config import RewardSource, SourceKind
    from reward_service.sources import build_source

    source = build_source(RewardSource(kind=SourceKind.reward_model, model_path=str(pipeline / "rm" / "model")))
    pairs = [json.loads(line) for line in (pipeline / "rm" / "data" / "rm_eval.jsonl").read_text().splitlines()]
    scores = source.score(
        [p["prompt"] for p in pairs] * 2,
        [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs],
        [{}] * (2 * len(pairs)),
    )
    assert abs(sum(scores) / len(scores)) < 0.2
    assert sum(c > r for c, r in zip(scores[: len(pairs)], scores[len(pairs) :])) / len(pairs) >= RM_ACCURACY


def test_ppo_on_the_reward_model_raises_its_reward_with_bounded_kl(pipeline):
    before = json.loads((pipeline / "ppo" / "eval_before.json").read_text())
    after = json.loads((pipeline / "ppo" / "eval_after.json").read_text())
    assert after["eval/sampled/reward/mean"] > before["eval/sampled/reward/mean"], (before, after)
    steps = [r for r in rows(pipeline / "ppo" / "metrics.jsonl") if "timing/total" in r]
    assert len(steps) == 40 and all(r["kl/ref"] < 0.5 for r in steps)  # bounded by the KL penalty
    assert not any("learner/explained_variance" in r for r in steps)  # RLOO: no critic ran


def test_relay_eval_reports_policy_against_reference(pipeline, tmp_path):
    from orchestrator.tools.eval_checkpoint import evaluate_checkpoint

    cfg = load_config(REPO / "configs" / "pipeline_tiny_cpu.yaml", [], root=PipelineConfig).ppo
    cfg.data.eval_size = 32
    checkpoint = pipeline / "ppo" / "checkpoints" / "step_40"
    report = evaluate_checkpoint(
        cfg, str(checkpoint), str(pipeline / "sft" / "model"), tmp_path, reward_model=str(pipeline / "rm" / "model")
    )
    for role in ("policy", "reference"):
        for key in (
            "sampled reward",
            "greedy accuracy",
            "KL to reference (per token)",
            "response length",
            "distinct-2",
        ):
            assert isinstance(report[role][key], float), (role, key)
    assert abs(report["reference"]["KL to reference (per token)"]) < 1e-3  # the reference against itself
    assert 0.0 <= report["win_rate_under_rm"] <= 1.0
    text = (tmp_path / "report.md").read_text()
    assert (
        "| greedy accuracy |" in text and "Win rate under the reward model" in text and "![curves](curves.png)" in text
    )
    assert (tmp_path / "curves.png").stat().st_size > 10_000  # the run's curves, found from the checkpoint's run


def test_sft_fine_tunes_a_pretrained_model_through_its_chat_template(ray_cluster, policy, tmp_path):
    """learner.model_path set: no scratch model; chat-message prompts rendered by the model's template."""
    from orchestrator.config.schema import StageConfig
    from orchestrator.stages.supervised import run_stage

    demos = tmp_path / "demos.jsonl"
    # shuffled: the first 16 lines are held out, and they must cover the range the rest trains on
    numbers = random.Random(0).sample(range(10, 90), 80)
    demos.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": f"{a}*2="}], "response": str(2 * a)}) + "\n"
            for a in numbers
        )
    )
    cfg = load_config(
        REPO / "configs" / "sft_tiny_cpu.yaml",
        [
            f"run_root={tmp_path}",
            "name=ft",
            "data.task=",
            f"data.train_files=[{demos}]",
            "data.eval_size=16",
            "data.apply_chat_template=true",
            f"learner.model_path={policy}",
            "learner.lr=1e-3",
            "train.steps=30",
            "train.eval_every=30",
            "train.batch_size=32",
            "train.micro_batch_size=32",
        ],
        root=StageConfig,
    )
    out = run_stage(cfg, "sft")
    summary = json.loads((out / "relay_sft.json").read_text())
    assert summary["after"]["eval/loss"] < 0.7 * summary["before"]["eval/loss"], summary
    assert not (tmp_path / "ft" / "init").exists()
    train = (tmp_path / "ft" / "metrics.jsonl").read_text()
    assert '"data/skipped_too_long": 0' in train
