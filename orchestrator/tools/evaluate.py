"""Evaluation, one module for the trainer's held-out checks and `relay eval`; and `relay plot RUN_DIR`.

`evaluate_policy` is read-only: it scores through the scoring service's `evaluate` (raw rewards; the
running reward normaliser never moves) and generates greedy answers only if `eval.greedy`.

On the config's held-out prompts, the policy against the reference, both generating through the
rollout engine: reward (combined and per source), greedy accuracy, KL to the reference, response
length, distinct-n diversity, and the win rate under a reward model. Written as report.md (with
greedy samples side by side) and report.json; with a run directory, PNG curves from its metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config.schema import TrainConfig, eval_samples
from orchestrator.data.builtin_models import resolve_run_judges
from orchestrator.data.prompts import load_split, policy_prompt, reward_metadata
from orchestrator.loop.step_metrics import VERIFIABLE, distinct_n, prompt_text, reward_metrics
from orchestrator.tools.pass_at_k import sample_metrics
from orchestrator.tools.suites import MAIN, figures, load_suites, markdown_table, suite_names, suite_sources
from reward_service.config import RewardSource, SourceKind
from reward_service.rules import answer_key, same_answer
from rollout.config import SamplingConfig
from runtime.seeds import EVALUATION

# (label in tables and report.json, metric key)
LABELS = [
    ("greedy accuracy", "eval/greedy/reward/accuracy"),
    ("greedy reward", "eval/greedy/reward/mean"),
    ("sampled accuracy", "eval/sampled/reward/accuracy"),
    ("sampled reward", "eval/sampled/reward/mean"),
    ("KL to reference (per token)", "eval/sampled/kl_ref"),
    ("response length", "eval/sampled/response/length_mean"),
    ("distinct-1", "eval/sampled/distinct_1"),
    ("distinct-2", "eval/sampled/distinct_2"),
]
CURVES = [
    ("reward/mean", "reward"),
    ("kl/ref", "KL to reference"),
    ("learner/entropy", "entropy"),
    ("response/length_mean", "response length"),
    ("kl/coef", "kl_coef"),
]


def win_rate(policy: list[float], reference: list[float]) -> float:
    """Share of prompts where the policy's answer outscores the reference's; ties count half."""
    return sum(1.0 if p > r else 0.5 if p == r else 0.0 for p, r in zip(policy, reference)) / len(policy)


@dataclass
class Evaluation:
    """One policy's held-out evaluation: its metrics, and the greedy and sampled batches with their scores."""

    metrics: dict[str, float]  # eval/greedy/..., eval/sampled/...
    greedy: object | None  # RolloutBatch of greedy answers (None when eval.greedy is off)
    greedy_scored: object | None  # its ScoredBatch (raw rewards)
    sampled: object  # RolloutBatch sampled as in training
    sampled_scored: object


def eval_sampling(cfg: TrainConfig) -> SamplingConfig:
    """Training's sampling with eval.n_samples samples per prompt (0: training's)."""
    return dataclasses.replace(cfg.rollout.sampling, n_samples_per_prompt=eval_samples(cfg))


def eval_ks(cfg: TrainConfig) -> list[int]:
    """The k of pass@k and maj@k: eval.pass_k, else 1 and n."""
    return sorted(set(cfg.eval.pass_k or [1, eval_sampling(cfg).n_samples_per_prompt]))


def evaluate_policy(
    generate,
    score,
    prompts: list,
    meta: list[dict],
    greedy: bool,
    temperature: float,
    policy_logprobs,
    pass_k: list[int] = (),
) -> Evaluation:
    """Held-out prompts: greedy answers (accuracy) if `greedy`, and samples as in training (reward,
    KL to the reference, length, diversity), with pass@k, maj@k and avg@n for each k of `pass_k` where
    a verifiable source judges them (pass_at_k). `generate(prompts, greedy) -> RolloutBatch`;
    `score(batch, meta, temperature, with_reference) -> ScoredBatch` must be read-only (raw rewards);
    `policy_logprobs(batch)`: the policy's logprob of each response token, computed by the same function
    as the reference's (not the engine's: its kernels, dtype and top-k/top-p renormalisation differ, and
    the KL of a policy to itself would not be 0)."""
    g = gs = None
    if greedy:
        g = generate(prompts, True)
        gs = score(g, meta, 1.0, False)  # nothing reads a KL of greedy answers
    s = generate(prompts, False)
    ss = score(s, meta, temperature, True)
    m = {f"eval/greedy/{k}": v for k, v in reward_metrics(gs).items()} if greedy else {}
    m.update({f"eval/sampled/{k}": v for k, v in reward_metrics(ss).items()})  # as training reports its batch
    acts = s.action_mask or [[1] * len(lp) for lp in s.logprobs]  # episodes: the model's tokens only
    kl = [
        p - r for lp, ref, act in zip(policy_logprobs(s), ss.ref_logprobs, acts) for p, r, a in zip(lp, ref, act) if a
    ]
    m["eval/sampled/kl_ref"] = sum(kl) / max(len(kl), 1)  # per model token, the k1 estimate on the sampler's tokens
    m["eval/sampled/response/length_mean"] = statistics.fmean(s.model_lengths)  # the model's tokens, as in training
    m["eval/sampled/distinct_1"], m["eval/sampled/distinct_2"] = distinct_n(s.model_ids, 1), distinct_n(s.model_ids, 2)
    m["eval/prompts"] = float(len(prompts))
    grader = next((k for k in ss.components if k.startswith(VERIFIABLE)), None)
    if pass_k and grader is not None:
        n = max(Counter(s.prompt_index).values(), default=0)
        same = same_answer if grader.startswith("math_answer") else str.__eq__  # the grader's notion of equal
        metrics = sample_metrics(graded_samples(s, ss, grader), n, pass_k, same)
        m.update({f"eval/sampled/{k}": v for k, v in metrics.items()})
    return Evaluation(m, g, gs, s, ss)


def evaluate_suites(suites: list, generate, score, cfg: TrainConfig, policy_logprobs) -> dict[str, float]:
    """Each evaluation suite (orchestrator/tools/suites.py) through evaluate_policy, its metrics under
    eval/<suite>/, with the training prompts its file held (left_out). `generate(prompts, greedy, meta)`,
    `score(batch, meta, temperature, with_reference, suite)`."""
    out = {}
    for suite in suites:
        ev = evaluate_policy(
            lambda p, greedy: generate(p, greedy, suite.meta),
            lambda b, meta, t, with_ref: score(b, meta, t, with_ref, suite.name),
            suite.prompts,
            suite.meta,
            cfg.eval.greedy,
            eval_sampling(cfg).temperature,
            policy_logprobs,
            eval_ks(cfg),
        )
        out |= {f"eval/{suite.name}/{k.removeprefix('eval/')}": v for k, v in ev.metrics.items()}
        out[f"eval/{suite.name}/left_out"] = float(suite.left_out)
    return out


def graded_samples(batch, scored, grader: str) -> list[tuple[list[bool], list[str]]]:
    """Per prompt, in sampling order, the (correct, answer) of each sample the verifiable source `grader`
    judged (correct: its full mark, a score >= 1; the answer as rules.answer_key reads it for that grader);
    a sample it could not judge (NaN) is left out, never counted wrong."""
    graded: dict[int, tuple[list[bool], list[str]]] = {}
    math = grader.startswith("math_answer")
    for j, score, text in zip(batch.prompt_index, scored.components[grader], batch.response_text):
        correct, answers = graded.setdefault(j, ([], []))
        if score == score:
            correct.append(score >= 1.0)
            answers.append(answer_key(text, math))
    return list(graded.values())


def rows(metrics: dict[str, float]) -> list[tuple[str, str]]:
    """LABELS, then the pass@k, maj@k and avg@n rows the evaluation reported, then each suite's figures,
    as (label, metric key)."""
    main = [(label, key) for label, key in figures(metrics, MAIN) if key.rsplit("/", 1)[1].count("@")]
    return LABELS + main + [(f"{s} {label}", key) for s in suite_names(metrics) for label, key in figures(metrics, s)]


def labelled(metrics: dict[str, float]) -> dict[str, float]:
    """The rows present in `metrics`, then each source's sampled mean, by label."""
    out = {label: metrics[key] for label, key in rows(metrics) if key in metrics}
    for key, value in metrics.items():
        name = key.removeprefix("eval/sampled/reward/").removesuffix("/mean")
        if key.startswith("eval/sampled/reward/") and key.endswith("/mean") and "/" not in name and name != "mean":
            out[f"sampled {name}"] = value
    return out


def summary_table(before: dict, after: dict) -> str:
    shown = [(label, key) for label, key in rows(before | after) if key in before or key in after]
    w = max([30] + [len(label) for label, _ in shown])
    lines = ["", f"{'held-out':{w}s} {'before':>10s} {'after':>10s}", "-" * (w + 22)]
    for label, key in shown:
        lines.append(f"{label:{w}s} {before.get(key, float('nan')):10.3f} {after.get(key, float('nan')):10.3f}")
    return "\n".join(lines)


def samples_table(rows: list[dict]) -> str:
    """Held-out prompts with the reference policy's greedy answer and the trained policy's."""

    def cell(text) -> str:
        return repr(text if len(text) <= 24 else text[:21] + "...") if text is not None else "-"

    def reward(value) -> str:
        return f"{value:6.2f}" if value is not None else "     -"

    lines = ["", f"{'prompt':26s} {'reference':28s} {'reward':>6s}  {'policy':28s} {'reward':>6s}", "-" * 100]
    for r in rows:
        lines.append(
            f"{cell(r['prompt']):26s} {cell(r['reference']):28s} {reward(r['reference_reward'])}  "
            f"{cell(r['policy']):28s} {reward(r['reward'])}"
        )
    return "\n".join(lines)


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
    }
    if reward_model:
        report["win_rate_under_rm"] = _win_rate(reward_model, scoring, evals, meta)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves = plot_run(run, out / "curves.png") if run else None
    report["table"] = markdown_table(evals["reference"].metrics, evals["policy"].metrics, ("reference", "policy"))
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report, evals, prompts, curves, cfg.eval.num_samples_to_log))
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


def evaluate_roles(
    cfg: TrainConfig, policy: str, reference: str, scoring, prompts: list, meta: list[dict], make_pool, suites=()
) -> dict[str, Evaluation]:
    """The policy's and the reference's evaluations, each generating through its own engine
    (`make_pool(path)`, shut down after), the suites' metrics (evaluate_suites) in its metrics. The KL's
    policy side is the role's own logprobs by the reference's function: for the reference role the scoring
    service's reference model itself, for the policy a copy built as that one is, freed before the
    reference's turn (no second reference)."""
    from reward_service.reference import ReferenceModel

    ref, temperature, evals = scoring.reference, cfg.rollout.sampling.temperature, {}
    for role, path in (("policy", policy), ("reference", reference)):
        model = (
            ref
            if role == "reference"
            else ReferenceModel(path, ref.dtype, ref.micro_batch_size, ref.chunk_tokens, ref.device)
        )
        pool = make_pool(path)
        try:
            evals[role] = evaluate_policy(
                lambda p, greedy: pool.generate(p, 0, greedy, eval_sampling(cfg), meta, EVALUATION),
                scoring.evaluate,
                prompts,
                meta,
                cfg.eval.greedy,
                temperature,
                functools.partial(model.logprobs, temperature=temperature),
                eval_ks(cfg),
            )
            evals[role].metrics |= evaluate_suites(
                suites,
                lambda p, greedy, m: pool.generate(p, 0, greedy, eval_sampling(cfg), m, EVALUATION),
                lambda b, m, t, with_ref, suite: scoring.evaluate(b, m, t, with_ref, suite),
                cfg,
                functools.partial(model.logprobs, temperature=temperature),
            )
        finally:
            pool.shutdown()
            del model  # the policy's copy: freed before the reference role runs
    return evals


def sample_rows(prompts: list, greedy, scored, k: int) -> list[dict]:
    """The first k held-out prompts with the policy's greedy answer and its reward (the reference
    columns are the trainer's to fill)."""
    return [
        {
            "prompt": prompt_text(prompts[j])[:60],
            "reference": None,
            "reference_reward": None,
            "policy": greedy.response_text[i],
            "reward": scored.rewards[i],
        }
        for i, j in enumerate(greedy.prompt_index[:k])
    ]


def shown(ev: Evaluation):
    """The answers a table shows: greedy ones, or the samples when greedy evaluation is off."""
    return (ev.greedy, ev.greedy_scored) if ev.greedy is not None else (ev.sampled, ev.sampled_scored)


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


def markdown(report: dict, evals: dict[str, Evaluation], prompts, curves: Path | None, k: int) -> str:
    greedy = evals["policy"].greedy is not None
    lines = [
        f"# relay eval: `{report['policy_path']}` vs `{report['reference_path']}`",
        "",
        f"{report['prompts']} held-out prompts; sampled metrics over the configured sampling"
        f"{', greedy at T=0' if greedy else ''}; raw rewards.",
        "",
        "| metric | policy | reference |",
        "|---|---|---|",
    ]
    for key in report["policy"]:
        lines.append(f"| {key} | {report['policy'][key]:.4f} | {report['reference'].get(key, float('nan')):.4f} |")
    lines += ["", "## Suites", "", "Each figure ± its standard error over prompts.", "", report["table"]]
    if "win_rate_under_rm" in report:
        lines += [
            "",
            f"Win rate under the reward model `{report['reward_model']}` ({'greedy' if greedy else 'sampled'} "
            f"answers, ties count half): **{report['win_rate_under_rm']:.3f}**",
        ]
    if curves:
        lines += ["", "## Training curves", "", f"![curves]({curves.name})"]
    lines += [
        "",
        f"## {'Greedy' if greedy else 'Sampled'} answers",
        "",
        "| prompt | reference | reward | policy | reward |",
        "|---|---|---|---|---|",
    ]
    (ref_batch, ref_scored), (pol, pol_scored) = shown(evals["reference"]), shown(evals["policy"])
    ref = {i: (t, r) for i, t, r in zip(ref_batch.prompt_index, ref_batch.response_text, ref_scored.rewards)}
    for i, text, reward in list(zip(pol.prompt_index, pol.response_text, pol_scored.rewards))[:k]:
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
