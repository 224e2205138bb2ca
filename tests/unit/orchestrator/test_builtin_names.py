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


def test_a_judges_builtin_model_is_resolved_and_only_a_judges(tmp_path):
    from orchestrator.data.builtin_models import builtin_folder, resolve_judges
    from reward_service.config import RewardSource, SourceKind

    name = "builtin://tiny-addition-gpt"
    builtin_folder(name, str(tmp_path)).mkdir(parents=True)  # as if built before: nothing is trained here
    sources = [
        RewardSource(kind=SourceKind.judge, model_path=name),
        RewardSource(kind=SourceKind.reward_model, model_path=name),  # a reward model's path is a folder, as given
        RewardSource(kind=SourceKind.judge, url="http://judge"),
    ]
    judge, rm, remote = resolve_judges(sources, str(tmp_path))
    assert judge.model_path == str(builtin_folder(name, str(tmp_path))) and rm.model_path == name
    assert remote == sources[2] and sources[0].model_path == name  # the config's own sources are left as they were
    with pytest.raises(ValueError, match=r"eval.suites.0.sources.1.model_path: unknown built-in model 'nope'"):
        resolve_judges(
            [sources[2], RewardSource(kind=SourceKind.judge, model_path="builtin://nope")], "r", "eval.suites.0.sources"
        )


def test_a_run_configs_judges_are_resolved_in_its_sources_and_its_suites(tmp_path):
    """relay train and relay eval share resolve_run_judges: the run's judges and each suite's, errors by key."""
    from orchestrator.config.schema import EvalSuite, TrainConfig
    from orchestrator.data.builtin_models import builtin_folder, resolve_run_judges
    from reward_service.config import RewardSource, SourceKind

    name = "builtin://tiny-addition-gpt"
    folder = str(builtin_folder(name, str(tmp_path)))
    builtin_folder(name, str(tmp_path)).mkdir(parents=True)
    cfg = TrainConfig(run_root=str(tmp_path))
    cfg.reward.sources = [RewardSource(kind=SourceKind.judge, model_path=name)]
    cfg.eval.suites = [EvalSuite(name="a"), EvalSuite(name="b", sources=[RewardSource(), cfg.reward.sources[0]])]
    resolve_run_judges(cfg)
    assert cfg.reward.sources[0].model_path == folder and cfg.eval.suites[1].sources[1].model_path == folder
    assert cfg.eval.suites[0].sources == [] and cfg.eval.suites[1].sources[0] == RewardSource()
    cfg.eval.suites[0].sources = [RewardSource(kind=SourceKind.judge, model_path="builtin://nope")]
    with pytest.raises(ValueError, match=r"eval.suites.0.sources.0.model_path: unknown built-in model 'nope'"):
        resolve_run_judges(cfg)


def test_serve_reward_reads_the_run_root_as_relay_train_does(tmp_path):
    """It loads the reward section alone; the run_root it builds builtin:// models under is still the config's."""
    from orchestrator.cli import _run_root

    config = tmp_path / "c.yaml"
    config.write_text(f"run_root: {tmp_path / 'mine'}\nreward:\n  sources: [{{kind: math_answer}}]\n")
    assert _run_root(config, []) == str(tmp_path / "mine")
    assert _run_root(config, ["reward.clip=1", "run_root=elsewhere"]) == "elsewhere"  # the command line wins
    assert _run_root(config, ["run_root=x", "run_root='my runs'"]) == "my runs"  # the last, read as YAML
    assert _run_root(config, ["run_root="]) == ""  # as load_config: the current directory
    config.write_text("reward:\n  sources: [{kind: math_answer}]\n")
    assert _run_root(config, []) == "runs"  # TrainConfig's default, as relay train
    config.write_text("run_root: 12\nreward:\n  sources: [{kind: math_answer}]\n")
    assert _run_root(config, []) == "12"
