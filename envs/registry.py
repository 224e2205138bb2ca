"""Environments by name: a built-in (envs/builtin.py) or any `module.path:Class`, and the factory
that makes one per episode. Apart from the interface (envs/base.py), so that the built-ins, which
subclass it, and the lookup, which lists them, import each other in one direction only."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from envs.builtin import BUILTIN


def load_env(name: str) -> type:
    """`module.path:Class` or a built-in name -> the Environment class; errors name `env.name`."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ValueError(f"env.name: {name!r} is neither a built-in ({', '.join(BUILTIN)}) nor 'module.path:Class'")
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"env.name: cannot load {name!r}: {e}") from None
    if not (inspect.isclass(cls) and callable(getattr(cls, "step", None))):
        raise ValueError(f"env.name: {name!r} is not a class with a step() method")
    return cls


def make_factory(name: str, options: dict[str, Any]) -> Callable[[], Any]:
    """A function making one environment per episode; builds one now so bad options fail at start."""
    cls = load_env(name)
    try:
        cls(**options)
    except TypeError as e:
        raise ValueError(f"env.options: {name} does not take these options: {e}") from None
    return lambda: cls(**options)
