"""scripts/metric_gate.py on hand-made run folders: window means, bands from seeds, and a failure that names the
figure, the steps, the band and the value."""

import json
import statistics

import pytest

from scripts.metric_gate import FIGURES, HELD_OUT, WINDOW, K, bands, check, figures, main

STEPS = 2 * WINDOW + 1  # two full windows and one of a single step


def fake_run(root, name, shift=0.0, reward_at=None):
    """A run folder: metrics.jsonl (training rows with every gated key, one eval row) and eval_after.json."""
    run = root / name
    run.mkdir()
    lines = []
    for step in range(1, STEPS + 1):
        row = {"step": step, "timing/total": 1.0, **{k: 0.1 * step + shift for k in FIGURES}}
        if reward_at and step in reward_at:
            row["reward/mean"] = reward_at[step]
        lines.append(json.dumps(row))
    lines.append(json.dumps({"step": STEPS, "eval/greedy/reward/accuracy": 0.9}))  # an eval row: not a training row
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "eval_after.json").write_text(json.dumps({k: 0.5 + shift for k in HELD_OUT}))
    return run


def test_figures_are_window_means_of_the_training_rows_and_the_held_out_ones(tmp_path):
    got = figures(fake_run(tmp_path, "a"))
    assert got["reward/mean steps 1-5"] == pytest.approx(0.3)  # mean of 0.1..0.5
    assert got["reward/mean steps 6-10"] == pytest.approx(0.8)
    assert got["reward/mean steps 11-11"] == pytest.approx(1.1)  # the last, short window
    assert got["eval/greedy/reward/accuracy"] == 0.5
    assert len(got) == 3 * len(FIGURES) + len(HELD_OUT)


def test_a_band_is_the_seeds_mean_plus_minus_k_deviations_never_under_the_floor():
    b = bands([{"reward/mean steps 1-5": v, "kl/ref steps 1-5": 0.05} for v in (0.2, 0.3, 0.4)])
    sd = statistics.stdev([0.2, 0.3, 0.4])
    assert b["reward/mean steps 1-5"]["low"] == pytest.approx(0.3 - K * sd)
    assert b["reward/mean steps 1-5"]["high"] == pytest.approx(0.3 + K * sd)
    assert b["kl/ref steps 1-5"]["low"] == pytest.approx(0.05 - FIGURES["kl/ref"])  # no spread: the floor
    assert b["reward/mean steps 1-5"]["seeds"] == [0.2, 0.3, 0.4]


def test_check_passes_a_run_in_every_band_and_names_each_figure_that_left_it(tmp_path, capsys):
    seeds = [fake_run(tmp_path, f"s{i}", shift=0.001 * i) for i in range(3)]
    out = tmp_path / "bands.json"
    assert main(["record", str(out), *map(str, seeds), "--why", "test"]) == 0
    recorded = json.loads(out.read_text())
    assert recorded["why"] == "test" and recorded["runs"] == ["s0", "s1", "s2"]
    assert main(["check", str(out), str(fake_run(tmp_path, "ok", shift=0.0015))]) == 0

    bad = fake_run(tmp_path, "bad", reward_at={6: -1.0})  # one step's reward collapses: steps 6-10 move by 0.18
    assert main(["check", str(out), str(bad)]) == 1
    err = capsys.readouterr().err
    band = recorded["bands"]["reward/mean steps 6-10"]
    value = (-1.0 + 0.7 + 0.8 + 0.9 + 1.0) / 5
    assert f"reward/mean steps 6-10 = {value:.4f}, outside its band [{band['low']:.4f}, {band['high']:.4f}]" in err
    assert err.count("outside its band") == 1  # the other windows and figures held


def test_a_figure_missing_on_either_side_fails_and_record_needs_three_seeds(tmp_path):
    recorded = {"bands": {"reward/mean steps 1-5": {"low": 0.0, "high": 1.0}}}
    assert check(recorded, {}) == ["reward/mean steps 1-5: missing from the run (the bands have it)"]
    assert check(recorded, {"reward/mean steps 1-5": 0.5, "kl/ref steps 1-5": 0.0}) == [
        "kl/ref steps 1-5: not in the bands (record them again)"
    ]
    with pytest.raises(SystemExit):
        main(["record", str(tmp_path / "b.json"), str(fake_run(tmp_path, "one")), "--why", "x"])
