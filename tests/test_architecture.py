"""Keep the architecture honest (../shared/DESIGN.md): imports follow the data, the math is pure."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("envs", "rollout", "reward_service", "learner", "orchestrator")
# who may import whom: a stage may import the types of the stage that feeds it; environments are
# played by the rollout workers and import no other package
ALLOWED = {
    "envs": set(),
    "rollout": {"envs"},
    "reward_service": {"rollout"},
    "learner": {"rollout", "reward_service"},
    "orchestrator": {"envs", "rollout", "reward_service", "learner"},
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


PURE_MATH = ("algorithms", "losses")  # learner/'s math modules: tensors in, tensors out


@pytest.mark.parametrize("module", PURE_MATH)
def test_math_core_imports_nothing_distributed_and_no_models_or_config(module):
    path = REPO / "learner" / f"{module}.py"
    mods = imported_modules(path)
    top = {m.split(".")[0] for m in mods}
    assert top <= {"__future__", "math", "torch", "typing", "collections", "dataclasses", "learner"}, top
    assert not any(m.startswith("torch.distributed") for m in mods)
    # of learner/, only the other pure modules (`from learner import algorithms`)
    from_learner = {a.name for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module == "learner" for a in node.names}
    dotted = {m.removeprefix("learner.") for m in mods if m.startswith("learner.")}
    assert from_learner | dotted <= set(PURE_MATH), from_learner | dotted


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_only_upstream_stages(package):
    offenders = []
    for path in (REPO / package).rglob("*.py"):
        for mod in imported_modules(path):
            top = mod.split(".")[0]
            if top in PACKAGES and top != package and top not in ALLOWED[package]:
                offenders.append(f"{path.relative_to(REPO)} imports {mod}")
    assert not offenders, offenders


def test_the_checker_sees_imports(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import ray\nfrom orchestrator.cli import main\n")
    assert imported_modules(bad) == {"ray", "orchestrator.cli"}


def test_no_source_file_is_a_god_file():
    long = [f"{p.relative_to(REPO)} ({n})" for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")
            if (n := p.read_text().count("\n")) > 400]
    assert not long, long
