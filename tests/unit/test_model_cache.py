"""The built tiny models are cached across test sessions (tests/helpers.py): a second build of the same
inputs is a cache hit, and a change of any build input (an argument, the builtin VERSIONS entry, a
source file the builder depends on) builds anew."""

import inspect
from pathlib import Path

from learner.tiny_gpt import init_tiny_gpt
from orchestrator.data import builtin_models
from tests.helpers import build_inputs, cache_key, cached_build, source_files, tiny_policy_inputs


def counting_build(calls: list):
    def build(out: Path) -> Path:
        calls.append(out)
        out.mkdir()
        (out / "weights").write_text(str(len(calls)))
        return out

    return build


def test_the_same_inputs_are_built_once_and_other_inputs_again(tmp_path):
    calls = []
    inputs = build_inputs(init_tiny_gpt, seed=0)
    first = cached_build("m", inputs, counting_build(calls), root=tmp_path)
    assert cached_build("m", inputs, counting_build(calls), root=tmp_path) == first and len(calls) == 1
    other = cached_build("m", build_inputs(init_tiny_gpt, seed=1), counting_build(calls), root=tmp_path)
    assert other != first and len(calls) == 2 and (other / "weights").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == sorted([first.name, other.name])  # no staging


def test_defaults_count_as_inputs_and_an_explicit_default_is_the_same_build():
    assert build_inputs(init_tiny_gpt) == build_inputs(init_tiny_gpt, seed=0)
    assert build_inputs(init_tiny_gpt, n_layer=3) != build_inputs(init_tiny_gpt)


def test_the_tiny_policy_key_follows_its_builtin_version(monkeypatch):
    before = cache_key(tiny_policy_inputs())
    monkeypatch.setitem(builtin_models.VERSIONS, "tiny-addition-gpt", builtin_models.VERSIONS["tiny-addition-gpt"] + 1)
    assert cache_key(tiny_policy_inputs()) != before


def test_the_tiny_policy_depends_on_its_training_loop_model_and_task_sources():
    from learner import sft, tiny_gpt

    files = set(source_files(builtin_models.build_tiny_policy))
    assert {Path(inspect.getsourcefile(m)) for m in (builtin_models, sft, tiny_gpt)} <= files, files


def test_an_edit_of_the_builders_source_builds_anew(monkeypatch, tmp_path):
    source = tmp_path / "a_builder.py"
    source.write_text("def build(out, seed=0):\n    return out\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import a_builder

    before = build_inputs(a_builder.build)
    assert build_inputs(a_builder.build) == before
    source.write_text("def build(out, seed=0):\n    return out  # trained differently\n")
    assert cache_key(build_inputs(a_builder.build)) != cache_key(before)
