"""A run's figure over steps (runs/<name>/pipeline.png; `relay plot`; relay eval's curves.png), drawn from
metrics.jsonl and the held-out evaluations beside it (eval_before.json, eval_after.json), so any finished
run can be redrawn.

First what a user of the run reads first: the raw reward, the held-out figures before and after training
(and at every eval.every_n_steps), the KL to the reference, the entropy and the response length. Then what
the pipeline did: each role's idle share, and, only where they change, the samples' staleness, the
importance ratio pi_prox/mu with the share of tokens its correction cut, and the KL coefficient (a sync
run's staleness is 0 and its ratio 1 throughout: flat panels that hid the rest)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

FLAT = 1e-3  # a curve whose finite values stay within this of each other carries no information


@dataclass(frozen=True)
class Panel:
    """One panel of the figure: its title and the metrics it may draw."""

    title: str
    patterns: tuple[str, ...]  # metric keys, as regular expressions, in drawing order
    only_if_changing: bool = False  # drawn only where one of its curves changes


PANELS = [
    Panel("reward (raw)", ("reward/mean", "reward/accuracy")),
    Panel(
        "held-out (before: step 0, after: the last step)",
        (
            "eval/greedy/reward/accuracy",
            "eval/greedy/reward/mean",
            "eval/sampled/reward/accuracy",
            "eval/sampled/reward/mean",  # avg@n and pass@1 with it: not drawn again
            r"eval/sampled/(pass|maj)@([2-9]|\d\d+)",
        ),
    ),
    Panel("KL to reference (per token)", ("kl/ref",)),
    Panel("entropy (per token)", ("learner/entropy",)),
    Panel("response length (tokens)", ("response/length_mean",)),
    Panel("idle share per role", ("pipeline/idle/rollout", "pipeline/idle/scoring", "pipeline/idle/learner")),
    Panel("staleness (policy versions)", ("async/staleness_mean", "async/staleness_max"), True),
    Panel(
        "importance ratio pi_prox / mu",
        ("off_policy/ratio_mean", "off_policy/ratio_max", "off_policy/clipped_frac"),
        True,
    ),
    Panel("KL coefficient", ("kl/coef",), True),
]
LABELS = {
    "eval/greedy/reward/accuracy": "greedy accuracy",
    "eval/greedy/reward/mean": "greedy reward",
    "eval/sampled/reward/accuracy": "sampled accuracy",
    "eval/sampled/reward/mean": "sampled reward",
}

Series = dict[str, list[tuple[int, float]]]  # label -> (step, value) points


def plot_run(metrics_path: Path, out: Path) -> Path | None:
    """Write the figure to `out` and return it; None if there are no training steps to draw."""
    metrics_path = Path(metrics_path)
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    before, after = (_read(metrics_path.parent / f"eval_{when}.json") for when in ("before", "after"))
    panels = choose_panels(rows, before, after)
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    n_rows = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(n_rows, 2, figsize=(11, 2.7 * n_rows), sharex=True, squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels):
        for label, points in series.items():
            sparse = len(points) <= 3  # before and after only: dashed, nothing was measured between
            ax.plot(*zip(*points), marker="o" if sparse else ".", linestyle="--" if sparse else "-", label=label)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    axes.flat[len(panels) - 1].xaxis.set_tick_params(labelbottom=True)  # an odd count: the last one's steps
    fig.suptitle(metrics_path.parent.name, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return Path(out)


def choose_panels(rows: list[dict], before: dict, after: dict) -> list[tuple[str, Series]]:
    """The panels to draw, in PANELS order, each with its curves: a panel none of whose metrics the run
    has is left out, as is an only_if_changing one whose curves are all flat (FLAT). `rows`: metrics.jsonl
    (training steps carry timing/total); `before`/`after`: the held-out evaluations at step 0 and after
    the last step ({} where there are none). A curve equal to an earlier one of its panel at every point
    (a batch's mean reward and its accuracy under one 0/1 grader) is drawn once, under both names."""
    steps = [r for r in rows if "timing/total" in r]
    if not steps:
        return []
    last = max(r["step"] for r in steps)
    keys = sorted({k for r in rows for k in r} | set(before) | set(after))
    out = []
    for panel in PANELS:
        series: Series = {}
        for key in [k for pattern in panel.patterns for k in keys if re.fullmatch(pattern, k)]:
            if key.startswith("eval/"):  # periodic evaluations and the final one's row, between before and after
                points = {r["step"]: r.get(key) for r in rows if key in r}
                # before/after only where they hold the key: a run without eval_after.json yet (stopped,
                # still running) keeps its last periodic evaluation's point
                points = _given(before, key, 0) | points | _given(after, key, last)
            else:
                points = {r["step"]: r.get(key) for r in steps}
            drawn = sorted((s, float(v)) for s, v in points.items() if v is not None)
            if drawn:
                series = _add(series, LABELS.get(key, key.removeprefix("eval/sampled/")), drawn)
        if series and not (panel.only_if_changing and all(_flat(p) for p in series.values())):
            out.append((panel.title, series))
    return out


def _add(series: Series, label: str, points: list[tuple[int, float]]) -> Series:
    same = next((name for name, drawn in series.items() if _equal(drawn, points)), None)
    if same is None:
        return series | {label: points}
    return {f"{name} = {label}" if name == same else name: drawn for name, drawn in series.items()}


def _equal(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    return len(a) == len(b) and all(s == t and (x == y or x != x and y != y) for (s, x), (t, y) in zip(a, b))


def _flat(points: list[tuple[int, float]]) -> bool:
    finite = [v for _, v in points if math.isfinite(v)]
    return not finite or max(finite) - min(finite) <= FLAT


def _given(evaluation: dict, key: str, step: int) -> dict[int, float]:
    """{step: the evaluation's value of key}, or {} where it has none."""
    return {step: evaluation[key]} if evaluation.get(key) is not None else {}


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
