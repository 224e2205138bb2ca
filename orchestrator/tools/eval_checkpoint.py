"""`relay eval`: a checkpoint's held-out evaluation (evaluate.py) against the reference, written as a report.

On the config's held-out prompts, the policy against the reference, both generating through the
rollout engine: reward (combined and per source), greedy accuracy, KL to the reference, response
length, distinct-n diversity, and the win rate under a reward model. Written as report.md (with
greedy samples side by side) and report.json; with a run directory, PNG curves from its metrics.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from orchestrator.config.schema import TrainConfig
from orchestrator.data.builtin_models import resolve_run_judges
from orchestrator.data.prompts import load_split, policy_prompt, reward_metadata
from orchestrator.tools.eval_report import labelled, markdown, shown
from orchestrator.tools.evaluate import Evaluation, evaluate_roles, win_rate
from orchestrator.tools.plots import plot_run
from orchestrator.tools.suites import load_suites, markdown_table, suite_sources
from reward_service.config import RewardSource, SourceKind


def resolve_policy(checkpoint: str) -> tuple[Path, Path | None]:
    """(model folder, the run directory if the checkpoint sits in one)."""
    path = Path(checkpoint)
    for sub in ("learner/policy", "policy"):
        if (path / sub / "config.json").exists():
            path = path / sub
            break
    run = next((p for p in path.parents if (p / "metrics.jsonl").exists()), None)
    return path, run


def evaluate_checkpoint(
    cfg: TrainConfig, checkpoint: str, reference: str, out_dir: str | Path, reward_model: str = "", run_dir: str = ""
) -> dict:
    import ray

    from rollout.pool import RolloutPool

    policy, found_run = resolve_policy(checkpoint)
    run = Path(run_dir) if run_dir else found_run
    reward_model = reward_model or next(
        (s.model_path for s in cfg.reward.sources if s.kind == SourceKind.reward_model), ""
    )
    train, held_out, _ = load_split(cfg.data, cfg.seed)
    suites = load_suites(cfg, train)
    prompts = [policy_prompt(e["prompt"], cfg.data.apply_chat_template) for e in held_out]
    meta = [reward_metadata(e, cfg.data.apply_chat_template) for e in held_out]
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    scoring = _eval_scoring(cfg, reference, reward_model)
    evals = evaluate_roles(
        cfg,
        str(policy),
        reference,
        scoring,
        prompts,
        meta,
        lambda path: RolloutPool(cfg.rollout, path, 1, cfg.seed, env=cfg.env),
        suites,
    )
    report = {
        "policy_path": str(policy),
        "reference_path": reference,
        "prompts": len(prompts),
        "reward_model": reward_model or None,
        **{role: labelled(ev.metrics) for role, ev in evals.items()},
        "notes": sorted({note for ev in evals.values() for note in ev.notes}),  # a figure left out, and why
    }
    if reward_model:
        report["win_rate_under_rm"] = _win_rate(reward_model, scoring, evals, meta)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves = plot_run(run / "metrics.jsonl", out / "curves.png") if run else None
    report["table"] = markdown_table(evals["reference"].metrics, evals["policy"].metrics, ("reference", "policy"))
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report, evals, prompts, curves, cfg.eval.num_samples_to_log))
    for note in report["notes"]:
        print(f"relay eval: {note}", flush=True)
    print(f"relay eval: {out / 'report.md'}", flush=True)
    return report


def _eval_scoring(cfg: TrainConfig, reference: str, reward_model: str):
    """relay eval's scoring service: reference logprobs from the reference model; a reward_model source
    left without a path (as in a pipeline config) scores with --reward-model."""
    from reward_service.service import ScoringService

    for i, s in enumerate(cfg.reward.sources):
        if s.kind == SourceKind.reward_model and not (s.model_path or reward_model):
            raise ValueError(f"reward.sources.{i}.model_path: empty; give the reward model with --reward-model")
    resolve_run_judges(cfg)  # after the cheap check: it may build a builtin:// judge's model
    sources = [
        dataclasses.replace(s, model_path=s.model_path or reward_model) if s.kind == SourceKind.reward_model else s
        for s in cfg.reward.sources
    ]
    reward = dataclasses.replace(cfg.reward, sources=sources, reference_model_path=reference)
    return ScoringService(reward, reference, suites=suite_sources(cfg))


def _win_rate(reward_model: str, scoring, evals: dict[str, Evaluation], meta: list[dict]) -> float:
    from reward_service.sources import build_source

    rm = build_source(RewardSource(kind=SourceKind.reward_model, model_path=reward_model))
    scores = {}
    for role, ev in evals.items():
        batch, _ = shown(ev)
        texts = scoring.reference.tokenizer.batch_decode(batch.prompt_ids, skip_special_tokens=True)
        per_sample = [meta[j] for j in batch.prompt_index]  # the prompts as given: the RM renders them as trained
        scores[role] = dict(zip(batch.prompt_index, rm.score(texts, batch.response_text, per_sample)))
    both = sorted(set(scores["policy"]) & set(scores["reference"]))
    return win_rate([scores["policy"][i] for i in both], [scores["reference"][i] for i in both])
