"""The held-out evaluation's report: the trainer's before/after and samples tables, and `relay eval`'s
report.md (eval_checkpoint.py). A run's curves: plots.py."""

from __future__ import annotations

from pathlib import Path

from orchestrator.loop.step_metrics import prompt_text
from orchestrator.tools.evaluate import Evaluation
from orchestrator.tools.suites import MAIN, figures, suite_names

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


def sample_rows(prompts: list, greedy, scored, k: int) -> list[dict]:
    """The first k held-out prompts with the policy's greedy answer and its reward (the reference
    columns are the trainer's to fill). `index`: the prompt's place in the held-out set, which names
    it (the text is cut to 60 characters for display, and prompts may share those)."""
    return [
        {
            "index": j,
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
    lines += [f"- {note}" for note in report.get("notes", [])]
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
