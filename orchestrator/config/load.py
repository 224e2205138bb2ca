"""Load the config tree from a YAML file plus `key=value` overrides, and validate it once.

Every failure is one `ConfigError` line naming the key and where its value came from
(file and line, or the command line), before Ray or any model starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import sys
import typing
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from learner.config import MOVED_ALGORITHM_KEYS, MOVED_ALGORITHM_VALUES
from orchestrator.config.correction import resolve_corrections
from orchestrator.config.dtype import resolve_dtypes
from orchestrator.config.lora import resolve_lora_sync
from orchestrator.config.methods import RECIPES, recipe_conflicts
from orchestrator.config.schema import PipelineConfig, StageConfig, TrainConfig
from orchestrator.config.validate import (
    validate,
    validate_model_paths,
    validate_pipeline,
    validate_reward,
    validate_stage,
)

SECTION_CHECKS = {"reward": validate_reward}
RECIPE_ROOTS = {TrainConfig: ("",), PipelineConfig: ("ppo.",)}  # where an algorithm section (and its method) sits
ROOT_CHECKS = {TrainConfig: validate, StageConfig: validate_stage, PipelineConfig: validate_pipeline}


class ConfigError(ValueError):
    """A config problem, reported as one line: `<where>: <key>: <what is wrong>`."""


def load_config(
    path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    section: str = "",
    root=TrainConfig,
    local: bool = False,
    dtype_lines: list[str] | None = None,
):
    """The validated config tree of type `root` (TrainConfig for `relay train`, StageConfig for
    sft/rm, PipelineConfig); with `section` (e.g. "reward"), only that section, checked alone, for
    commands that need nothing else from the file. `local`: also check that the model folders it names
    exist on this machine (the commands that start work). Every `dtype: auto` comes back resolved
    (orchestrator/config/dtype.py); its line, and a warning for bf16 without native bf16, go to
    `dtype_lines` when given, else to stderr."""
    path = Path(path)
    text = _read(path)
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    _check_duplicates(path, yaml.compose(text))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top, got {type(data).__name__}")

    def in_file(key: str) -> str:
        return _where_in_file(path, text, key)

    _check_tree(data, root, "", in_file)
    cfg = _merge(OmegaConf.structured(root), OmegaConf.create(data), in_file)
    from_cli: dict[str, str] = {}
    for item in overrides:
        key, eq, value = (part.strip() for part in item.partition("="))
        where = f"command line {item!r}"
        if not eq or not key:
            raise ConfigError(f"{where}: overrides are key=value")
        _check_path(key, lambda _k, where=where: where, root)
        from_cli[key] = item
        try:
            OmegaConf.update(cfg, key, yaml.safe_load(value) if value else "", merge=True)
        except (OmegaConfBaseException, yaml.YAMLError) as e:
            raise ConfigError(f"{where}: {key}: {_first_line(e)}") from None

    def origin(key: str) -> str:
        return f"command line {from_cli[key]!r}" if key in from_cli else in_file(key)

    if not section:
        _apply_recipe(cfg, root, _given(data) | set(from_cli), origin)
    try:
        tree = OmegaConf.to_object(cfg[section] if section else cfg)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{path}: {e.full_key}: required, but no value was given") from None
    lines = _resolve_and_check(tree, root, section, local, origin)
    if dtype_lines is None:
        print(*(f"relay: {line}\n" for line in lines), sep="", end="", file=sys.stderr, flush=True)
    else:
        dtype_lines += lines
    return tree


def _resolve_and_check(tree, root, section: str, local: bool, origin) -> list[str]:
    """The tree's `dtype: auto` resolved (the lines to print returned), then its checks; the first
    problem raises, named by `origin(key)`."""
    lines, undecided = resolve_dtypes(tree) if not section else ([], [])
    lines += resolve_corrections(tree) + resolve_lora_sync(tree) if not section else []
    checks = SECTION_CHECKS[section](tree) if section else ROOT_CHECKS[root](tree)
    for key, problem in itertools.chain(undecided, checks, validate_model_paths(tree) if local and not section else ()):
        raise ConfigError(f"{origin(key)}: {key}: {problem}")
    return lines


def _apply_recipe(cfg: DictConfig, root, given: set[str], where) -> None:
    """algorithm.method's keys (orchestrator/config/methods.py) onto the merged tree, refusing a key the user
    gave another value."""
    for prefix in RECIPE_ROOTS.get(root, ()):
        method = OmegaConf.select(cfg, prefix + "algorithm.method")
        for key, problem in recipe_conflicts(method, lambda k: OmegaConf.select(cfg, k), given, prefix):
            raise ConfigError(f"{where(key)}: {key}: {problem}")
        for key, value in RECIPES[method].items():
            OmegaConf.update(cfg, prefix + key, value, merge=True)


def _given(node, prefix: str = "") -> set[str]:
    """Dotted keys a YAML mapping sets (lists count as one key)."""
    if not isinstance(node, dict):
        return set()
    return {f"{prefix}{k}" for k in node} | {key for k, v in node.items() for key in _given(v, f"{prefix}{k}.")}


def to_yaml(tree: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(tree))


def to_dict(tree: TrainConfig) -> dict:
    """Plain containers (enums as strings): for wandb, checkpoints and the run directory."""
    return OmegaConf.to_container(OmegaConf.structured(tree), enum_to_str=True)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror}") from None


def _moved(key: str, table: dict[str, str]) -> str | None:
    """`<old> moved to <new>` when `key` is an algorithm key that moved into a sub-section (learner.config)."""
    head, _, name = key.rpartition(".")
    if head.rpartition(".")[2] == "algorithm" and name in table:
        return f"{key} moved to {head}.{table[name]}"
    return None


def _unknown(key: str, name: str, known: list[str], where) -> ConfigError:
    moved = _moved(key, MOVED_ALGORITHM_KEYS)
    if moved:
        return ConfigError(f"{where(key)}: {key}: {moved}")
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
    return ConfigError(f"{where(key)}: {key}: unknown key; {hint}")


def _list_item_type(typ):
    """The dataclass held by a `list[SomeDataclass]` field, else None."""
    args = typing.get_args(typ)
    return args[0] if args and dataclasses.is_dataclass(args[0]) else None


def _check_tree(node, cls, prefix: str, where) -> None:
    """Unknown keys anywhere in the tree, and types inside lists of sections (which a merge
    would report without their path)."""
    if not isinstance(node, dict):
        return
    hints = typing.get_type_hints(cls)
    for k, v in node.items():
        key = f"{prefix}{k}"
        if k not in hints:
            raise _unknown(key, str(k), list(hints), where)
        item_cls = _list_item_type(hints[k])
        _check_moved_value(key, dataclasses.is_dataclass(hints[k]) and not isinstance(v, dict | None), where)
        if dataclasses.is_dataclass(hints[k]):
            _check_tree(v, hints[k], f"{key}.", where)
        elif item_cls and isinstance(v, list):
            for i, item in enumerate(v):
                _check_tree(item, item_cls, f"{key}.{i}.", where)
                _merge(OmegaConf.structured(item_cls), OmegaConf.create(item or {}), where, prefix=f"{key}.{i}.")


def _check_moved_value(key: str, scalar_for_section: bool, where) -> None:
    """A value given where a sub-section now holds it (algorithm.reinforce_baseline: batch)."""
    moved = _moved(key, MOVED_ALGORITHM_VALUES) if scalar_for_section else None
    if moved:
        raise ConfigError(f"{where(key)}: {key}: {moved}")


def _check_path(key: str, where, root=TrainConfig) -> None:
    """A dotted override key must name a field (list elements by index), not a section."""
    cls, done = root, []
    for part in key.split("."):
        if cls is None:
            break
        if isinstance(cls, list):  # inside a list of sections: expect an index
            if not part.isdigit():
                raise ConfigError(f"{where(key)}: {key}: {'.'.join(done)} is a list; index it by number")
            cls = cls[0]
        else:
            hints = typing.get_type_hints(cls)
            if part not in hints:
                raise _unknown(key, part, list(hints), where)
            typ = hints[part]
            cls = typ if dataclasses.is_dataclass(typ) else ([_list_item_type(typ)] if _list_item_type(typ) else None)
        done.append(part)
    _check_moved_value(key, dataclasses.is_dataclass(cls), where)


def _merge(base: DictConfig, extra: DictConfig, where, prefix: str = "") -> DictConfig:
    """Merge; type and enum errors become one line naming the key."""
    try:
        return OmegaConf.merge(base, extra)
    except OmegaConfBaseException as e:
        key = prefix + (e.full_key or "?").replace("[", ".").replace("]", "")
        raise ConfigError(f"{where(key)}: {key}: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    return (getattr(e, "msg", None) or str(e)).splitlines()[0]


def _check_duplicates(path: Path, node, prefix: str = "") -> None:
    """YAML keeps the last of two equal keys without a word; a config must not."""
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for k, v in node.value:
            line = k.start_mark.line + 1
            if k.value in first:
                raise ConfigError(f"{path}:{line}: {prefix}{k.value}: duplicate key (first at line {first[k.value]})")
            first[k.value] = line
            _check_duplicates(path, v, f"{prefix}{k.value}.")
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _check_duplicates(path, v, f"{prefix}{i}.")


def _where_in_file(path: Path, text: str, key: str) -> str:
    """`file:line` of `key` (dotted, list indices as numbers) in the YAML text, or just the file."""
    node, line = yaml.compose(text), None
    for part in key.split("."):
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if k.value == part]
            if not match:
                break
            line, node = match[0][0].start_mark.line + 1, match[0][1]
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            break
    return f"{path}:{line}" if line else str(path)
