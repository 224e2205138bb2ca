"""Built-in starting policies by name: an unknown one is named with the known ones, and the SmolLM2 preset loads."""

import pytest

from orchestrator.config.load import load_config
from orchestrator.data.builtin_models import resolve_model_path
from tests.helpers import REPO


def test_unknown_builtin_is_named(tmp_path):
    known = "known: tiny-addition-gpt, tiny-longtail-gpt, smollm2"
    with pytest.raises(ValueError, match=f"unknown built-in model 'nope'; {known}"):
        resolve_model_path("builtin://nope", str(tmp_path))


def test_smollm2_preset_loads():
    cfg = load_config(REPO / "configs" / "grpo_smollm2_cpu.yaml", [])
    assert cfg.learner.model_path == "builtin://smollm2-135m-instruct" and cfg.data.apply_chat_template
