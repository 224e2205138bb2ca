"""Every config field explains itself: its comment is read from its dataclass, printed beside its
value by `relay config show`, and written with the resolved tree to the run folder at launch."""

import sys
import types
import typing
from dataclasses import dataclass, field

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.config.docs import commented_yaml, config_types, field_comments, record_launch, section_type
from orchestrator.config.load import load_config, to_dict, to_yaml
from orchestrator.config.schema import PipelineConfig, StageConfig, TrainConfig
from tests.helpers import REPO

DEFAULT = REPO / "configs" / "grpo_tiny_cpu.yaml"
PIPELINE = REPO / "configs" / "pipeline_tiny_cpu.yaml"


def undocumented(*roots) -> list[str]:
    return [
        f"{cls.__module__}.{cls.__name__}.{name}"
        for root in roots
        for cls in config_types(root)
        for name, comment in field_comments(cls).items()
        if not comment
    ]


def test_every_config_field_has_a_comment():
    missing = undocumented(TrainConfig, StageConfig, PipelineConfig)
    assert not missing, "config fields need a docstring under them: " + ", ".join(missing)


@dataclass
class _Item:
    weight: float = 1.0
    """how much it counts"""


@dataclass
class _Example:
    plain: int = 0  # a comment is no documentation
    hashed: str = "#### N"
    """the "#" inside the string is no comment"""
    wrapped: list[str] = field(default_factory=lambda: ["a"])
    """a docstring that
    wraps over lines"""
    items: list[_Item] = field(default_factory=list)
    """a list of sections"""


def test_field_comments_reads_the_docstring_under_each_field():
    assert field_comments(_Example) == {
        "plain": "",
        "hashed": 'the "#" inside the string is no comment',
        "wrapped": "a docstring that wraps over lines",
        "items": "a list of sections",
    }
    assert config_types(_Example) == [_Example, _Item]
    assert undocumented(_Example) == [f"{__name__}._Example.plain"]  # the check above fails on a new bare field


def test_section_type():
    assert section_type(TrainConfig) == (TrainConfig, False)
    assert section_type(list[_Item]) == (_Item, True)
    assert section_type(list[str]) == (None, False) and section_type(int) == (None, False)


def _fields(data: dict, cls) -> list[tuple[str, str]]:
    """(field name, comment) of every field in the tree, in print order."""
    out = []
    for name, value in data.items():
        out.append((name, field_comments(cls)[name]))
        sub, many = section_type(typing.get_type_hints(cls)[name])
        for item in (value if many else [value]) if sub else []:
            out += _fields(item, sub)
    return out


def show(capsys, *args) -> str:
    assert main(["config", "show", *map(str, args)]) == 0
    return capsys.readouterr().out


def test_config_show_prints_every_field_with_its_comment(capsys):
    out = show(capsys, DEFAULT, "algorithm.clip_eps=0.1")
    cfg = load_config(DEFAULT, ["algorithm.clip_eps=0.1"])
    expected = _fields(to_dict(cfg), TrainConfig)
    lines = out.splitlines()
    assert len(lines) == len(expected)  # one line per field, nothing else
    for line, (name, comment) in zip(lines, expected):
        assert line.lstrip(" -").startswith(f"{name}:") and line.endswith(f"  # {comment}"), line
    assert "  clip_eps: 0.1  # " in out and "\n  sources:  # " in out and "\n    - kind: math_answer  # " in out
    assert yaml.safe_load(out) == yaml.safe_load(to_yaml(cfg))


def test_config_show_keeps_awkward_values_valid_yaml(capsys):
    overrides = [
        "rollout.sampling.stop=['</answer>', '# end', 'a: b', \"it's\"]",
        "data.prompt_key=" + "k" * 300,
        'reward.sources.0.pattern="<think>\\n.*#.*"',
        "reward.sources.0.name=':{x}'",
    ]
    out = show(capsys, DEFAULT, *overrides)
    assert yaml.safe_load(out) == yaml.safe_load(to_yaml(load_config(DEFAULT, overrides)))
    assert yaml.safe_load(out)["reward"]["sources"][0]["pattern"] == "<think>\n.*#.*"


def test_config_show_bare_prints_plain_yaml(capsys):
    out = show(capsys, "--bare", DEFAULT)
    assert out == to_yaml(load_config(DEFAULT)) and "#" not in out


def test_config_show_for_a_pipeline_nests_sections_and_lists(capsys):
    out = show(capsys, "--for", "pipeline", PIPELINE)
    cfg = load_config(PIPELINE, root=PipelineConfig)
    assert yaml.safe_load(out) == yaml.safe_load(to_yaml(cfg))
    assert "\n      - kind: reward_model  # " in out and "\n        weight: 0.0  # " in out
    assert len(out.splitlines()) == len(_fields(to_dict(cfg), PipelineConfig))


def test_record_launch_writes_the_config_and_returns_a_short_summary(tmp_path):
    cfg = load_config(DEFAULT, [f"run_root={tmp_path}"])
    summary = record_launch(cfg, "train")
    run = tmp_path / "grpo_tiny_cpu"
    assert summary == "\n".join(
        [
            "relay train",
            f"  run folder  {run}",
            "  model       builtin://tiny-addition-gpt",
            "  algorithm   grpo, KL k3 in the loss, fixed coef 0.01",
            "  workers     1 rollout worker(s), 1 learner rank(s), colocated",
            "  dtype       float32 (learner and engines)",
            "  steps       25 steps x 64 prompts x 8 samples",
            f"  config      {run / 'config.yaml'}",
        ]
    )
    in_flight = load_config(DEFAULT, [f"run_root={tmp_path}", "name=async", "async_training.mode=in_flight"])
    assert "  async       in_flight, off-policy correction tis" in record_launch(in_flight, "train").splitlines()
    for precision, held in (
        ("autocast", "autocast over float32 weights"),
        ("master_weights", "bf16 weights, float32 masters, ZeRO 2"),
    ):
        bf16 = ["learner.dtype=bfloat16", "rollout.dtype=bfloat16", f"learner.precision={precision}"]
        bf16 = load_config(DEFAULT, [f"run_root={tmp_path}", f"name={precision}", *bf16])
        assert f"  dtype       bfloat16 (learner and engines; {held})" in record_launch(bf16, "train").splitlines()
    written = (run / "config.yaml").read_text()
    assert written.startswith("# relay train: ") and written.endswith(commented_yaml(cfg))
    assert load_config(run / "config.yaml") == cfg  # the written file is a config that runs again


def test_record_launch_of_stages_and_pipeline(tmp_path):
    sft = load_config(REPO / "configs" / "sft_tiny_cpu.yaml", [f"run_root={tmp_path}"], root=StageConfig)
    assert record_launch(sft, "sft").splitlines()[1:6] == [
        f"  run folder  {tmp_path / 'sft_tiny_cpu'}",
        "  model       scratch GPT-2 (2 layers x 128, char tokenizer)",
        "  data        task addition_2digit (5000 examples)",
        "  workers     1 learner rank(s)",
        "  steps       600 steps x 64 sequences",
    ]
    pipe = load_config(PIPELINE, [f"run_root={tmp_path}", "ppo.algorithm.init_kl_coef=0"], root=PipelineConfig)
    lines = record_launch(pipe, "pipeline").splitlines()
    assert lines[3] == "  rm          2400 steps x 64 pairs, model the SFT model"
    assert lines[4] == "  ppo         rloo, no KL penalty; 15 steps x 32 prompts x 4 samples"
    assert load_config(tmp_path / "pipeline_tiny_cpu" / "config.yaml", root=PipelineConfig) == pipe


@pytest.mark.parametrize("command", ["train", "sft", "pipeline"])
def test_launch_commands_print_the_summary_not_the_config(command, tmp_path, capsys, monkeypatch):
    """The CLI path up to the run, with the run itself replaced (no Ray, no model)."""
    ran = []

    class Trainer:
        def __init__(self, cfg):
            ran.append(cfg)

        def run(self, stop=None):
            pass

        def shutdown(self):
            pass

    monkeypatch.setitem(sys.modules, "orchestrator.loop.trainer", types.SimpleNamespace(Trainer=Trainer))
    monkeypatch.setitem(
        sys.modules,
        "orchestrator.stages.supervised",
        types.SimpleNamespace(run_stage=lambda cfg, kind: ran.append(cfg)),
    )
    monkeypatch.setitem(sys.modules, "orchestrator.stages.pipeline", types.SimpleNamespace(run_pipeline=ran.append))
    config = {"train": DEFAULT, "sft": REPO / "configs" / "sft_tiny_cpu.yaml", "pipeline": PIPELINE}[command]
    assert main([command, str(config), f"run_root={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert len(ran) == 1 and out == record_launch(ran[0], command) + "\n"
    assert len(out.splitlines()) <= 8 and "#" not in out
    assert (tmp_path / ran[0].name / "config.yaml").exists()
