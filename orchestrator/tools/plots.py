"""runs/<name>/pipeline.png: what the pipeline did, step by step, next to the reward: each role's
idle share (where it waited), the samples' staleness, and the importance ratio pi_prox/mu with the
share of tokens its correction cut. Drawn from metrics.jsonl, so any finished run can be redrawn."""

from __future__ import annotations

import json
import re
from pathlib import Path

PANELS = [  # (title, [metric keys, as regular expressions])
    ("reward", ["reward/mean", "reward/accuracy"]),
    ("idle share per role", ["pipeline/idle/rollout", "pipeline/idle/scoring", "pipeline/idle/learner"]),
    ("staleness (policy versions)", ["async/staleness_mean", "async/staleness_max"]),
    ("importance ratio pi_prox / mu", ["off_policy/ratio_mean", "off_policy/ratio_max", "off_policy/clipped_frac"]),
    ("held-out pass@k, maj@k (at eval.every_n_steps)", [r"eval/sampled/(pass|maj|avg)@\d+"]),
]


def plot_run(metrics_path: Path, out: Path) -> Path | None:
    """Write the figure to `out` and return it; None if there are no training steps to draw."""
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing/total" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), 1, figsize=(7, 2.4 * len(PANELS)), sharex=True)
    for ax, (title, keys) in zip(axes, panel_keys(rows)):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker=".", label=key.split("/", 1)[1])
        ax.set_title(title, fontsize=9)
        if ax.lines:  # a panel the run has no metrics for stays empty, without a legend
            ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def panel_keys(rows: list[dict]) -> list[tuple[str, list[str]]]:
    """Each panel's title and the metric keys of `rows` its patterns match, in pattern order."""
    found = sorted({k for r in rows for k in r})
    return [(title, [k for pattern in keys for k in found if re.fullmatch(pattern, k)]) for title, keys in PANELS]
