"""The config explains itself: a field's documentation is the docstring under it in its dataclass.
`relay config show` prints it beside the value, and every launch writes the resolved tree that way
to <run folder>/config.yaml, so the terminal only needs a short summary.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import textwrap
import typing
from pathlib import Path

import yaml

from learner.config import KLControllerKind
from learner.precision import zero_stage
from orchestrator.config.load import to_dict


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """{field name: the docstring under the field} of a dataclass, in field order; "" where none."""
    docs, body = {}, ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr):
            if isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def section_type(hint) -> tuple[type | None, bool]:
    """(the dataclass a field holds, whether as a list of them); (None, False) for a plain value."""
    if dataclasses.is_dataclass(hint):
        return hint, False
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0], True
    return None, False


def field_types(cls: type) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def config_types(root: type) -> list[type]:
    """Every dataclass reachable from `root` through its fields (lists of sections too), root first."""
    found = [root]
    for cls in found:  # grows while we walk it
        for hint in field_types(cls).values():
            sub, _ = section_type(hint)
            if sub is not None and sub not in found:
                found.append(sub)
    return found


# ---------------------------------------------------------------------------- YAML with comments
def commented_yaml(tree) -> str:
    """The tree as block YAML, each value followed by its field's comment. It parses (yaml.safe_load)
    to the same data as `to_yaml(tree)`: values are written in flow style on one line."""
    return "\n".join(_lines(to_dict(tree), type(tree), "")) + "\n"


def _lines(data: dict, cls: type, pad: str) -> list[str]:
    docs, types, out = field_comments(cls), field_types(cls), []
    for name, value in data.items():
        sub, many = section_type(types[name])
        note = f"  # {docs[name]}" if docs[name] else ""
        if sub is not None and not many:
            out += [f"{pad}{name}:{note}", *_lines(value, sub, pad + "  ")]
        elif sub is not None and value:  # a list of sections: "- " opens each item's first field
            out.append(f"{pad}{name}:{note}")
            for item in value:
                item_lines = _lines(item, sub, pad + "    ") or [f"{pad}    {{}}"]
                item_lines[0] = f"{pad}  - {item_lines[0].lstrip()}"
                out += item_lines
        else:
            out.append(f"{pad}{name}: {_flow(value)}{note}")
    return out


def _flow(value) -> str:
    """One value as YAML on one line, quoted where needed (a string with a line break as JSON,
    which YAML reads as a double-quoted scalar)."""
    text = yaml.safe_dump([value], default_flow_style=True, width=math.inf, allow_unicode=True).strip()
    return json.dumps(value) if "\n" in text else text[1:-1]  # [1:-1]: drop the wrapping list's brackets


# ---------------------------------------------------------------------------- launch
def record_launch(cfg, command: str) -> str:
    """Write the resolved, commented config to <run_root>/<name>/config.yaml (the run folder, made if
    needed) and return the few lines the terminal gets instead: `command` is train, sft, rm or pipeline."""
    run_dir = Path(cfg.run_root) / cfg.name
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(
        f"# relay {command}: the resolved config of this run; `relay config show` explains it too\n"
        + commented_yaml(cfg)
    )
    if command == "train":
        rows = [
            ("model", cfg.learner.model_path),
            ("algorithm", _algorithm(cfg.algorithm)),
            ("workers", _workers(cfg.cluster)),
            ("dtype", _dtypes(cfg)),
            *_async(cfg),
            ("steps", _rl_steps(cfg)),
        ]
    elif command == "pipeline":
        rows = [
            ("sft", f"{_stage_steps(cfg.sft, 'sft')}, model {_stage_model(cfg.sft)}"),
            ("rm", f"{_stage_steps(cfg.rm, 'rm')}, model {cfg.rm.learner.model_path or 'the SFT model'}"),
            ("ppo", f"{_algorithm(cfg.ppo.algorithm)}; {_rl_steps(cfg.ppo)}"),
            ("workers", _workers(cfg.ppo.cluster)),
        ]
    else:
        rows = [
            ("model", _stage_model(cfg)),
            ("data", _stage_data(cfg)),
            ("workers", f"{cfg.learner_ranks} learner rank(s)"),
            ("steps", _stage_steps(cfg, command)),
        ]
    rows = [("run folder", str(run_dir)), *rows, ("config", str(path))]
    width = max(len(label) for label, _ in rows)
    return "\n".join([f"relay {command}", *(f"  {label:{width}s}  {text}" for label, text in rows)])


def _algorithm(a) -> str:
    if a.init_kl_coef == 0:
        return f"{a.estimator.value}, no KL penalty"
    kl = (
        f"{a.estimator.value}, KL {a.kl_estimator.value} in the {a.kl_placement.value}, "
        f"{a.kl_controller.value} coef {a.init_kl_coef:g}"
    )
    return kl + (f" (target {a.target_kl:g})" if a.kl_controller == KLControllerKind.adaptive else "")


def _dtypes(cfg) -> str:
    """The learner's and the engines' dtype, as resolved at launch (dtype: auto), and how a bf16 learner holds its
    weights (learner.precision)."""
    learner, engines = getattr(cfg.learner.dtype, "value", cfg.learner.dtype), cfg.rollout.dtype
    masters = f"; bf16 weights, float32 masters, ZeRO {zero_stage(cfg.learner)}"  # 2 at least
    held = {"master_weights": masters, "autocast": "; autocast over float32 weights"}
    precision = str(getattr(cfg.learner.precision, "value", cfg.learner.precision))
    how = held.get(precision, "") if learner == "bfloat16" else ""
    return (
        f"{learner} (learner and engines{how})" if learner == engines else f"{learner} learner{how}, {engines} engines"
    )


def _async(cfg) -> list[tuple[str, str]]:
    mode = cfg.async_training.mode
    if mode.value == "sync":
        return []
    return [("async", f"{mode.value}, off-policy correction {cfg.algorithm.off_policy.correction.value}")]


def _workers(c) -> str:
    engines = f"{c.rollout_workers} rollout worker(s)" + " (elastic)" * c.elastic
    return f"{engines}, {c.learner_ranks} learner rank(s)" + (
        ", colocated" if c.colocate else ", own placement bundles"
    )


def _rl_steps(cfg) -> str:
    return (
        f"{cfg.total_steps} steps x {cfg.data.rollout_batch_size} prompts"
        f" x {cfg.rollout.sampling.n_samples_per_prompt} samples"
    )


def _stage_steps(cfg, kind: str) -> str:
    return f"{cfg.train.steps} steps x {cfg.train.batch_size} {'pairs' if kind == 'rm' else 'sequences'}"


def _stage_model(cfg) -> str:
    s = cfg.scratch
    return cfg.learner.model_path or f"scratch GPT-2 ({s.n_layer} layers x {s.n_embd}, {s.tokenizer} tokenizer)"


def _stage_data(cfg) -> str:
    d = cfg.data
    return f"task {d.task} ({d.task_size} examples)" if d.task else ", ".join(d.train_files)
