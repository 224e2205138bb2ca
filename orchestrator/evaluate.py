"""`relay eval CHECKPOINT --reference PATH` and `relay plot RUN_DIR`.

On the config's held-out prompts, the policy against the reference, both generating through the
rollout engine: reward (combined and per source), greedy accuracy, KL to the reference, response
length, distinct-n diversity, and the win rate under a reward model. Written as report.md (with
greedy samples side by side) and report.json; with a run directory, PNG curves from its metrics.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from orchestrator.config import TrainConfig
from orchestrator.data import load_split
from orchestrator.phases import prompt_text
from reward_service.config import Normalization, RewardSource, SourceKind

CURVES = [("reward/mean", "reward"), ("kl/ref", "KL to reference"), ("learner/entropy", "entropy"),
          ("response/length_mean", "response length"), ("kl/coef", "kl_coef")]


def distinct_n(sequences: list[list[int]], n: int) -> float:
    """Distinct n-grams over all n-grams of the responses (Li et al. 2016); 0 when there are none."""
    grams = [tuple(s[i: i + n]) for s in sequences for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def win_rate(policy: list[float], reference: list[float]) -> float:
    """Share of prompts where the policy's answer outscores the reference's; ties count half."""
    return sum(1.0 if p > r else 0.5 if p == r else 0.0 for p, r in zip(policy, reference)) / len(policy)


def resolve_policy(checkpoint: str) -> tuple[Path, Path | None]:
    """(model folder, the run directory if the checkpoint sits in one)."""
    path = Path(checkpoint)
    for sub in ("learner/policy", "policy"):
        if (path / sub / "config.json").exists():
            path = path / sub
            break
    run = next((p for p in path.parents if (p / "metrics.jsonl").exists()), None)
    return path, run


def evaluate_checkpoint(cfg: TrainConfig, checkpoint: str, reference: str, out_dir: str | Path,
                        reward_model: str = "", run_dir: str = "") -> dict:
    import ray

    from reward_service.service import ScoringService
    from rollout.pool import RolloutPool

    policy, found_run = resolve_policy(checkpoint)
    run = Path(run_dir) if run_dir else found_run
    reward_model = reward_model or next((s.model_path for s in cfg.reward.sources if s.kind == SourceKind.reward_model), "")
    _, held_out, _ = load_split(cfg.data, cfg.seed)
    prompts = [[{"role": "user", "content": e["prompt"]}] if cfg.data.apply_chat_template and isinstance(e["prompt"], str)
               else e["prompt"] for e in held_out]
    meta = [{"answer": e["answer"], **e["metadata"]} for e in held_out]
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    generations = {}
    for role, path in (("policy", str(policy)), ("reference", reference)):
        pool = RolloutPool(cfg.rollout, path, 1, cfg.seed)
        try:
            generations[role] = (pool.generate(prompts, step=0, greedy=True), pool.generate(prompts, step=0))
        finally:
            pool.shutdown()
    # raw rewards (no normalisation), reference logprobs from the reference model; a reward_model
    # source left without a path (as in a pipeline config) scores with --reward-model
    sources = [dataclasses.replace(s, model_path=s.model_path or reward_model) if s.kind == SourceKind.reward_model else s
               for s in cfg.reward.sources]
    for i, s in enumerate(sources):
        if s.kind == SourceKind.reward_model and not s.model_path:
            raise ValueError(f"reward.sources.{i}.model_path: empty; give the reward model with --reward-model")
    reward_cfg = dataclasses.replace(cfg.reward, sources=sources, normalization=Normalization.none,
                                     reference_model_path=reference)
    scoring = ScoringService(reward_cfg, reference)
    temperature = cfg.rollout.sampling.temperature
    report = {"policy_path": str(policy), "reference_path": reference, "prompts": len(prompts),
              "reward_model": reward_model or None}
    scored = {}
    for role, (greedy, sampled) in generations.items():
        g, s = scoring.score(greedy, meta, 1.0), scoring.score(sampled, meta, temperature)
        scored[role] = g
        report[role] = _metrics(greedy, sampled, g, s)
    if reward_model:
        report["win_rate_under_rm"] = _win_rate(reward_model, scoring, generations)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves = plot_run(run, out / "curves.png") if run else None
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report, generations, scored, prompts, curves, cfg.eval.num_samples_to_log))
    print(f"relay eval: {out / 'report.md'}", flush=True)
    return report


def _metrics(greedy, sampled, g, s) -> dict[str, float]:
    kl = [b - r for lp, ref in zip(sampled.logprobs, s.ref_logprobs) for b, r in zip(lp, ref)]
    m = {"sampled reward": statistics.fmean(s.rewards), "greedy reward": statistics.fmean(g.rewards),
         "KL to reference (per token)": sum(kl) / max(len(kl), 1),
         "response length": statistics.fmean(sampled.response_lengths),
         "distinct-1": distinct_n(sampled.response_ids, 1), "distinct-2": distinct_n(sampled.response_ids, 2)}
    for name, values in s.components.items():
        good = [v for v in values if v == v]
        if good:
            m[f"sampled {name}"] = statistics.fmean(good)
    for name, values in g.components.items():
        good = [v for v in values if v == v]
        if good and name.startswith(("math_answer", "exact_match", "reasoning_gym")):
            m["greedy accuracy"] = statistics.fmean(good)
    return m


def _win_rate(reward_model: str, scoring, generations) -> float:
    from reward_service.sources import build_source

    rm = build_source(RewardSource(kind=SourceKind.reward_model, model_path=reward_model))
    scores = {}
    for role, (greedy, _) in generations.items():
        texts = scoring.reference.tokenizer.batch_decode(greedy.prompt_ids, skip_special_tokens=True)
        scores[role] = dict(zip(greedy.prompt_index, rm.score(texts, greedy.response_text, [{}] * len(texts))))
    both = sorted(set(scores["policy"]) & set(scores["reference"]))
    return win_rate([scores["policy"][i] for i in both], [scores["reference"][i] for i in both])


def markdown(report: dict, generations, scored, prompts, curves: Path | None, k: int) -> str:
    lines = [f"# relay eval: `{report['policy_path']}` vs `{report['reference_path']}`", "",
             f"{report['prompts']} held-out prompts; sampled metrics over the configured sampling, greedy at T=0.", "",
             "| metric | policy | reference |", "|---|---|---|"]
    for key in report["policy"]:
        lines.append(f"| {key} | {report['policy'][key]:.4f} | {report['reference'].get(key, float('nan')):.4f} |")
    if "win_rate_under_rm" in report:
        lines += ["", f"Win rate under the reward model `{report['reward_model']}` (greedy answers, ties count half): "
                      f"**{report['win_rate_under_rm']:.3f}**"]
    if curves:
        lines += ["", "## Training curves", "", f"![curves]({curves.name})"]
    lines += ["", "## Greedy samples", "", "| prompt | reference | reward | policy | reward |", "|---|---|---|---|---|"]
    ref = {i: (t, r) for i, t, r in zip(generations["reference"][0].prompt_index, generations["reference"][0].response_text,
                                        scored["reference"].rewards)}
    pol = generations["policy"][0]
    for i, text, reward in list(zip(pol.prompt_index, pol.response_text, scored["policy"].rewards))[:k]:
        rt, rr = ref.get(i, ("", float("nan")))
        lines.append(f"| {_cell(prompt_text(prompts[i]))} | {_cell(rt)} | {rr:.2f} | {_cell(text)} | {reward:.2f} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return "`" + text.replace("|", "\\|").replace("\n", "\\n").replace("`", "'")[:80] + "`"


def plot_run(run_dir: str | Path, out: str | Path) -> Path:
    """One PNG of a run's curves over steps (reward, KL, entropy, response length, kl_coef)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing/total" in r]
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2))
    for ax, (key, title) in zip(axes, CURVES):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), marker=".")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)
