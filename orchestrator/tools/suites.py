"""Evaluation suites (`eval.suites`): named held-out sets beside the data's own, e.g. a harder task for
generalisation, each evaluated by the held-out evaluation's code (orchestrator/tools/evaluate.py) and
reported apart under eval/<suite>/; and the markdown table of a report: suite x metric, before and after,
with the prompts and samples behind each figure."""

from __future__ import annotations

import re
from dataclasses import dataclass

from orchestrator.config.schema import TrainConfig
from orchestrator.data.prompts import policy_prompt, reward_metadata, suite_examples

MAIN = "held_out"  # the data's own held-out set, in tables (its metrics are eval/greedy/..., eval/sampled/...)
# a suite's figures in a report, by their key under eval/<suite>/
FIGURES = [
    ("greedy accuracy", "greedy/reward/accuracy"),
    ("sampled accuracy", "sampled/reward/accuracy"),
    ("sampled reward", "sampled/reward/mean"),
]


@dataclass
class Suite:
    """One suite's prompts as the engines take them, each prompt's reward metadata, and the training
    prompts its file held (left out)."""

    name: str
    prompts: list
    meta: list[dict]
    left_out: int


def load_suites(cfg: TrainConfig, train: list[dict]) -> list[Suite]:
    template = cfg.data.apply_chat_template
    suites = []
    for spec in cfg.eval.suites:
        examples, left_out = suite_examples(spec, cfg.data, cfg.seed, train)
        prompts = [policy_prompt(e["prompt"], template) for e in examples]
        suites.append(Suite(spec.name, prompts, [reward_metadata(e, template) for e in examples], left_out))
    return suites


def suite_sources(cfg: TrainConfig) -> dict[str, list]:
    """The reward sources of each evaluation suite that has its own (the scoring service builds them)."""
    return {suite.name: suite.sources for suite in cfg.eval.suites if suite.sources}


def suite_names(metrics: dict) -> list[str]:
    """The suites a metrics dict holds (each reports eval/<suite>/prompts), in order."""
    return [k.split("/")[1] for k in metrics if re.fullmatch(r"eval/[^/]+/prompts", k)]


def figures(metrics: dict, suite: str) -> list[tuple[str, str]]:
    """(label, metric key) of a suite's figures in `metrics`: FIGURES, then pass@k, maj@k and avg@n."""
    base = "eval/" if suite == MAIN else f"eval/{suite}/"
    k_keys = sorted(
        (k for k in metrics if re.fullmatch(re.escape(base) + r"sampled/(pass|maj|avg)@\d+", k)),
        key=lambda k: (k.rsplit("/", 1)[1].split("@")[0], int(k.rsplit("@", 1)[1])),
    )
    return [(label, base + key) for label, key in FIGURES if base + key in metrics] + [
        (k.rsplit("/", 1)[1], k) for k in k_keys
    ]


def markdown_table(before: dict, after: dict, columns: tuple[str, str] = ("before", "after")) -> str:
    """Suite x metric, before and after (± the standard error where there is one), with each suite's
    prompts and samples per prompt: a table to paste."""
    lines = [f"| suite | metric | {columns[0]} | {columns[1]} | prompts x samples |", "|---|---|---|---|---|"]
    for suite in [MAIN, *suite_names(after)]:
        base = "eval/" if suite == MAIN else f"eval/{suite}/"
        size = f"{after.get(base + 'prompts', after.get('eval/prompts', float('nan'))):.0f} x {_n(after, base)}"
        for label, key in figures(after, suite):
            lines.append(f"| {suite} | {label} | {_cell(before, key)} | {_cell(after, key)} | {size} |")
    return "\n".join(lines) + "\n"


def _n(metrics: dict, base: str) -> str:
    avg = [k for k in metrics if re.fullmatch(re.escape(base) + r"sampled/avg@\d+", k)]
    return avg[0].rsplit("@", 1)[1] if avg else "?"


def _cell(metrics: dict, key: str) -> str:
    if key not in metrics:
        return "-"
    se = metrics.get(key + "/se")
    return f"{metrics[key]:.3f}" + (f" ± {se:.3f}" if se is not None and se == se else "")
