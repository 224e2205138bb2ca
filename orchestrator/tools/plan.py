"""`relay plan`: the memory each role needs, per device, before anything is launched.

Pure arithmetic on a model's shape (its config.json, or a small table of known architectures), counted as
the code allocates: ZeRO 0-3 with AdamW, HF eager layers, runtime/logprobs.py's chunks, vLLM's memory
fraction, async training's staged weights. tests/unit/orchestrator/test_plan.py checks it against real CPU steps.

The arithmetic: plan_model.py (one model), plan_roles.py (each role), plan_devices.py (a config's roles and
devices); here the command's part: the config loaded, the plan made for the machine, and the printed report."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.tools.plan_devices import Plan, plan_pipeline, plan_stage, plan_train
from orchestrator.tools.plan_model import GB, SAFETY, fmt
from orchestrator.tools.plan_roles import total


# ---------------------------------------------------------------- the report
def load(path: str | Path, overrides: list[str], dtype_lines: list[str] | None = None):
    """(kind, config): the root is told by the file's top-level sections, as `relay config show --for`.
    The lines saying what each `dtype: auto` became, and why, go to `dtype_lines` (load_config's)."""
    import yaml

    from orchestrator.config.load import load_config
    from orchestrator.config.schema import PipelineConfig, StageConfig

    try:
        top = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        top = None  # load_config names the problem
    keys = set(top) if isinstance(top, dict) else set()
    if keys & {"sft", "rm", "ppo"}:
        return "pipeline", load_config(path, overrides, root=PipelineConfig, dtype_lines=dtype_lines)
    if keys & {"scratch", "train", "learner_ranks"}:
        cfg = load_config(path, overrides, root=StageConfig, dtype_lines=dtype_lines)
        return ("sft" if "scratch" in keys or not cfg.learner.model_path else "rm"), cfg
    return "train", load_config(path, overrides, dtype_lines=dtype_lines)


def _machine_bytes() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def make_plan(kind: str, cfg, gpu_gb: float, host_gb: float | None) -> Plan:
    """host_gb None: this machine's memory when every role is on the host, else not judged."""
    c = cfg.ppo.cluster if kind == "pipeline" else (cfg.cluster if kind == "train" else None)
    on_gpu = c is not None and (c.gpus_per_learner > 0 or c.gpus_per_rollout_worker > 0 or c.gpus_per_scoring > 0)
    host = host_gb * GB if host_gb is not None else (None if on_gpu else _machine_bytes())
    if kind == "pipeline":
        return plan_pipeline(cfg, gpu_gb * GB, host)
    if kind == "train":
        return plan_train(cfg, gpu_gb * GB, host)
    return plan_stage(cfg, kind, host)


def render(plan: Plan, path, gpu_gb: float, dtype_lines: tuple[str, ...] | list[str] = ()) -> str:
    """The report; `dtype_lines` (load's) say which dtype an `auto` became and why, and the planned
    figures are in that dtype."""
    out = [
        f"relay plan: {path} ({'fits' if plan.fits else 'DOES NOT FIT'}; {gpu_gb:g} GB GPUs, "
        f"a device fits when its peak <= {SAFETY:.0%} of it)",
        *dtype_lines,
        "models:",
    ]
    out += [f"  {m}" for m in plan.models]
    for role, lines in plan.sections:
        out.append(f"{role}:")
        out += [f"  {what:<26}{fmt(b):>12}  {how}" for what, b, how in lines]
        out.append(f"  {'total':<26}{fmt(total(lines)):>12}")
    out.append("devices (peak, limit):")
    for name, peak, limit in plan.devices:
        verdict = "not judged (give --host-memory-gb)" if limit is None else ("ok" if peak <= limit else "OVER")
        out.append(f"  {name:<58}{fmt(peak):>12}  / {'-' if limit is None else fmt(limit)}  {verdict}")
    out += [f"problem: {p}" for p in plan.problems]
    out.append(f"verdict: {'fits' if plan.fits else 'does not fit'}")
    return "\n".join(out) + "\n"
