"""pipeline.png's panels (orchestrator/tools/plots.py): what a run's reader looks at first, the held-out
figures before and after, and the pipeline's panels only where they change (issue 40, item 12)."""

import json
import math

from orchestrator.tools.plots import choose_panels, plot_run

STEPS = 6
HELD_OUT = {
    "eval/greedy/reward/mean": 0.75,
    "eval/greedy/reward/accuracy": 0.75,
    "eval/sampled/reward/mean": 0.4,
    "eval/sampled/reward/accuracy": 0.4,
    "eval/sampled/avg@8": 0.4,
    "eval/sampled/pass@1": 0.4,
    "eval/sampled/pass@1/se": 0.02,
    "eval/sampled/pass@8": 0.9,
    "eval/sampled/maj@8": 0.6,
    "eval/prompts": 128.0,
}


def step_row(step: int, async_run: bool) -> dict:
    """One training step's row as the trainer writes it; a sync run's staleness and ratio are flat."""
    row = {"step": step, "timing/total": 0.6, "reward/mean": 0.3 + 0.05 * step, "kl/ref": 0.01 * (step - 1)}
    row |= {"learner/entropy": 0.45 - 0.01 * step, "response/length_mean": 3.5 + 0.1 * (step % 2), "kl/coef": 0.01}
    row |= {f"pipeline/idle/{role}": 0.5 + 0.02 * (step % 3) for role in ("rollout", "scoring", "learner")}
    row["reward/accuracy"] = row["reward/mean"]
    stale = float(step > 1) if async_run else 0.0
    row |= {"async/staleness_mean": stale, "async/staleness_max": stale, "off_policy/clipped_frac": 0.0}
    ratio_max = 1.2 + 0.1 * (step % 3) if async_run and step > 1 else 1.000007  # sync: float noise around 1
    return row | {"off_policy/ratio_mean": 1.0, "off_policy/ratio_max": ratio_max}


def scaled(metrics: dict, by: float) -> dict:
    return {k: v * by if k != "eval/prompts" else v for k, v in metrics.items()}


def titles(panels) -> list[str]:
    return [title.split(" (")[0] for title, _ in panels]


FIRST = ["reward", "held-out", "KL to reference", "entropy", "response length", "idle share per role"]


def test_a_sync_run_without_periodic_evaluations_draws_what_its_reader_looks_at_first(tmp_path):
    # eval.every_n_steps: 0 (the default): no eval/ key in a step's row, only the final evaluation's own row
    rows = [step_row(s, async_run=False) for s in range(1, STEPS + 1)] + [{"step": STEPS} | scaled(HELD_OUT, 1.2)]
    panels = choose_panels(rows, HELD_OUT, scaled(HELD_OUT, 1.2))
    assert titles(panels) == FIRST  # no flat staleness, ratio or kl_coef panel, no empty one
    series = dict(panels)
    held_out = next(s for title, s in panels if title.startswith("held-out"))
    assert list(held_out) == ["greedy accuracy = greedy reward", "sampled accuracy = sampled reward", "maj@8", "pass@8"]
    assert held_out["maj@8"] == [(0, 0.6), (STEPS, 0.6 * 1.2)]  # before at step 0, after at the last step
    assert list(series["reward (raw)"]) == ["reward/mean = reward/accuracy"]  # one curve, both names
    assert [s for s, _ in series["entropy (per token)"]["learner/entropy"]] == list(range(1, STEPS + 1))
    # the files beside metrics.jsonl, as the trainer leaves them: a PNG with the before/after points
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval_before.json").write_text(json.dumps(HELD_OUT))
    (tmp_path / "eval_after.json").write_text(json.dumps(scaled(HELD_OUT, 1.2)))
    out = plot_run(tmp_path / "metrics.jsonl", tmp_path / "pipeline.png")
    assert out == tmp_path / "pipeline.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_async_run_adds_its_staleness_and_ratio_panels_and_the_periodic_evaluations():
    rows = [step_row(s, async_run=True) for s in range(1, STEPS + 1)]
    for row in rows[1::2]:  # eval.every_n_steps: 2, the last step's evaluation being the final one
        row |= scaled(HELD_OUT, 1 + row["step"] / 100)
    panels = choose_panels(rows, HELD_OUT, scaled(HELD_OUT, 1.06))
    assert titles(panels) == FIRST + ["staleness", "importance ratio pi_prox / mu"]
    held_out = next(s for title, s in panels if title.startswith("held-out"))
    assert [s for s, _ in held_out["pass@8"]] == [0, 2, 4, 6]
    staleness = dict(panels)["staleness (policy versions)"]["async/staleness_mean = async/staleness_max"]
    assert staleness[:2] == [(1, 0.0), (2, 1.0)]


def test_a_run_without_evaluations_or_learner_metrics_leaves_their_panels_out():
    rows = [{"step": s, "timing/total": 1.0, "reward/mean": float("nan") if s == 2 else 0.5} for s in (1, 2, 3)]
    panels = choose_panels(rows, {}, {})
    assert titles(panels) == ["reward"] and math.isnan(dict(panels)["reward (raw)"]["reward/mean"][1][1])
    assert choose_panels([{"step": 1, "eval/greedy/reward/mean": 0.5}], {}, {}) == []  # no training step


def test_a_run_without_its_final_evaluation_keeps_its_last_periodic_point():
    """`relay plot` of a run still going (or stopped) has no eval_after.json: the periodic evaluation at its
    last step is drawn, not overwritten by the missing final one."""
    rows = [step_row(s, async_run=False) for s in range(1, STEPS + 1)]
    for row in rows[1::2]:  # eval.every_n_steps: 2; steps 2, 4 and 6 evaluated
        row |= scaled(HELD_OUT, 1 + row["step"] / 100)
    held_out = next(s for title, s in choose_panels(rows, HELD_OUT, {}) if title.startswith("held-out"))
    assert [s for s, _ in held_out["pass@8"]] == [0, 2, 4, 6]
    assert held_out["pass@8"][-1] == (6, HELD_OUT["eval/sampled/pass@8"] * 1.06)
