"""Keep the architecture honest (../shared/DESIGN.md): imports follow the data, the math is pure."""

import ast
from pathlib import Path

import pytest

from tests.helpers import REPO

PACKAGES = ("runtime", "envs", "rollout", "reward_service", "learner", "orchestrator")
# who may import whom, by package or by module (a module: it and what it defines). A stage may import
# the types of the stage that feeds it: learner and reward_service take of rollout/ only its batch type,
# and the learner the weight-sync protocol, which the receiving side defines. runtime (what every
# process needs at run time) imports none of relay's packages, and every package may import it.
# Environments are played by the rollout workers and import no other package but runtime.
ALLOWED = {
    "runtime": set(),
    "envs": {"runtime"},
    "rollout": {"runtime", "envs"},
    "reward_service": {"runtime", "rollout.types"},
    "learner": {"runtime", "rollout.types", "rollout.weight_sync", "reward_service.types", "reward_service.rules"},
    "orchestrator": {"runtime", "envs", "rollout", "reward_service", "learner"},
}


def imported_names(path: Path) -> set[str]:
    """Every dotted name a file imports, at module level or inside a function: `import a.b` gives
    a.b, `from a.b import c` gives a.b.c (c a module of a.b or a name defined in it)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def within(name: str, entry: str) -> bool:
    """`name` is the package or module `entry`, or lies inside it."""
    return name == entry or name.startswith(entry + ".")


# the math modules (tensors in, tensors out) and the one each may import of relay: one another
PURE_MATH = ("learner.algorithms", "learner.off_policy", "learner.losses", "runtime.logprobs")


@pytest.mark.parametrize("module", PURE_MATH)
def test_math_core_imports_nothing_distributed_and_no_models_or_config(module):
    names = imported_names(REPO / f"{module.replace('.', '/')}.py")
    top = {m.split(".")[0] for m in names}
    assert top <= {"__future__", "math", "torch", "typing", "collections", "dataclasses", "learner", "runtime"}, top
    assert not any(m.startswith("torch.distributed") for m in names)
    # of relay, only the other pure modules (`from learner import algorithms`, `from runtime.logprobs import f`):
    # runtime.logprobs is allowed because it passes this very test
    relay = {m for m in names if m.split(".")[0] in PACKAGES}
    assert all(any(within(m, pure) for pure in PURE_MATH) for m in relay), relay


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_only_upstream_stages(package):
    offenders = []
    for path in (REPO / package).rglob("*.py"):
        for name in imported_names(path):
            top = name.split(".")[0]
            if top in PACKAGES and top != package and not any(within(name, e) for e in ALLOWED[package]):
                offenders.append(f"{path.relative_to(REPO)} imports {name}")
    assert not offenders, offenders


# inside orchestrator/, by group: config/ imports no other group, data/ only config/
ORCHESTRATOR_GROUPS = {"config": set(), "data": {"config"}}


@pytest.mark.parametrize("group", sorted(ORCHESTRATOR_GROUPS))
def test_orchestrator_groups_import_only_what_they_may(group):
    others = {"cli", "loop", "config", "data", "tools", "stages"} - {group} - ORCHESTRATOR_GROUPS[group]
    offenders = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in (REPO / "orchestrator" / group).rglob("*.py")
        for name in imported_names(path)
        if name.split(".")[0] == "orchestrator" and len(name.split(".")) > 1 and name.split(".")[1] in others
    ]
    assert not offenders, offenders


MAP = REPO / "docs" / "architecture.md"


def module_map_rules() -> dict[str, set[str]]:
    """The "may import" table at the end of docs/architecture.md: {package: the names it may import}."""
    text = MAP.read_text().split("## Who may import whom")[1]
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| `")]
    return {pkg.strip().strip("`"): {n.strip().strip("`") for n in may.split(",") if "`" in n} for pkg, may in rows}


def test_the_module_map_draws_the_import_rules_this_test_enforces():
    assert module_map_rules() == ALLOWED


def test_the_module_map_names_every_module():
    text = MAP.read_text()
    missing = [
        str(p.relative_to(REPO))
        for pkg in PACKAGES
        for p in (REPO / pkg).rglob("*.py")
        if p.name != "__init__.py" and f"`{p.relative_to(REPO)}`" not in text
    ]
    assert not missing, f"add these to {MAP.relative_to(REPO)}: {missing}"


def undocumented(path: Path) -> list[str]:
    """The module, and each public top-level class of it, that has no docstring."""
    tree = ast.parse(path.read_text())
    missing = [] if ast.get_docstring(tree) else [str(path.relative_to(REPO))]
    return missing + [
        f"{path.relative_to(REPO)}:{n.name}"
        for n in tree.body
        if isinstance(n, ast.ClassDef) and not n.name.startswith("_") and not ast.get_docstring(n)
    ]


def test_every_module_and_public_class_says_what_it_owns():
    missing = [m for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") for m in undocumented(p)]
    assert not missing, missing


def test_the_checker_sees_imports(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import ray\nfrom orchestrator.cli import main\n\ndef f():\n    from rollout import config\n")
    assert imported_names(bad) == {"ray", "orchestrator.cli.main", "rollout.config"}
    assert within("rollout.types.RolloutBatch", "rollout.types") and not within("rollout.typesetting", "rollout.types")


def import_cycle(package_dir: Path) -> list[str]:
    """A cycle of imports between the modules of one package (module-level and function-level ones,
    so a lazy import inside a function counts), as [a, b, ..., a]; [] when there is none."""
    pkg = package_dir.name
    modules = {
        ".".join((pkg, *p.relative_to(package_dir).with_suffix("").parts)).removesuffix(".__init__"): p
        for p in package_dir.rglob("*.py")
    }

    def module_of(name: str) -> str | None:  # the longest prefix of `name` that is a module of the package
        parts = name.split(".")
        return next((m for m in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if m in modules), None)

    graph = {
        m: sorted({t for n in imported_names(p) if (t := module_of(n)) and t != m}) for m, p in sorted(modules.items())
    }
    state: dict[str, str] = {}  # "open": on the current path, "done": no cycle through it

    def visit(m: str, path: list[str]) -> list[str]:
        state[m] = "open"
        for t in graph[m]:
            if state.get(t) == "open":
                return path[path.index(t) :] + [m, t] if t in path else [m, t]
            if t not in state and (cycle := visit(t, path + [m])):
                return cycle
        state[m] = "done"
        return []

    for m in graph:
        if m not in state and (cycle := visit(m, [])):
            return cycle
    return []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_a_package(package):
    assert import_cycle(REPO / package) == []


def test_the_cycle_check_sees_lazy_imports(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from p import c\n")
    (pkg / "c.py").write_text("import p.a\n")
    (pkg / "d.py").write_text("from p.a import x\n")  # imports into the cycle, is not on it
    assert import_cycle(pkg) == ["p.a", "p.b", "p.c", "p.a"]
    (pkg / "c.py").write_text("import os\n")
    assert import_cycle(pkg) == []


MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 8  # beyond it, a dataclass says what travels together


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
    return len([n for n in names if n.arg not in ("self", "cls")])


def oversized(path: Path, root: Path = REPO) -> list[str]:
    """`path:function` for each function over MAX_FUNCTION_LINES lines or MAX_PARAMETERS parameters."""
    return [
        f"{path.relative_to(root)}:{node.name}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES or parameters(node) > MAX_PARAMETERS)
    ]


def test_functions_stay_short_and_take_few_parameters():
    found = [f for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") for f in oversized(p)]
    assert not found, "split these, or pass a dataclass"


def test_the_shape_check_counts_lines_and_parameters(tmp_path):
    f = tmp_path / "x.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    f.write_text(
        f"def short(self, a, b, c, d, e, f, g, h):\n{body}\n\ndef long(a):\n{body}\n    y = 1\n    z = 2\n"
        "def wide(a, b, c, d, e, f, g, h, *rest):\n    pass\n"
    )
    assert oversized(f, tmp_path) == ["x.py:long", "x.py:wide"]


def test_no_source_line_is_over_120_characters():
    files = [
        p for pkg in (*PACKAGES, "tests", "bench", "scripts", "examples", "deploy") for p in (REPO / pkg).rglob("*.py")
    ]
    long = [
        f"{p.relative_to(REPO)}:{i}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if len(line) > 120
    ]
    assert not long, long


MAX_FILE_LINES = 400  # beyond it a module holds more than one responsibility: split it by what each part holds
MAX_TRAINER_LINES = (
    250  # the Trainer is the loop; recovery, restore, incidents and checkpoints are objects of their own
)


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_source_file_is_over_400_lines():
    files = [p for pkg in (*PACKAGES, "scripts", "bench", "examples") for p in (REPO / pkg).rglob("*.py")]
    long = {str(p.relative_to(REPO)): n for p in files if (n := line_count(p)) > MAX_FILE_LINES}
    assert not long, f"split these by responsibility: {long}"


def test_the_trainer_is_the_loop():
    assert line_count(REPO / "orchestrator" / "loop" / "trainer.py") < MAX_TRAINER_LINES
