"""Keep the README and docs/ honest: the configs they name load, their links lead to files, and the README's
fresh-machine commands are the ones CI runs."""

import re

import pytest
import yaml

from orchestrator.config.load import load_config
from orchestrator.config.schema import PipelineConfig, StageConfig, TrainConfig
from tests.helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TRAIN = "bash scripts/install.sh cpu && .venv/bin/relay train"
TEST = "bash scripts/install.sh cpu && bash scripts/test.sh"


def configs_named() -> list[str]:
    return sorted({m for page in PAGES for m in re.findall(r"configs/[\w.\-]+\.yaml", page.read_text())})


def root_of(path) -> type:
    """The config tree a file is for, told by its top-level sections (as `relay config show --for` says)."""
    top = set(yaml.safe_load(path.read_text()))
    if top & {"sft", "rm", "ppo"}:
        return PipelineConfig
    return StageConfig if top & {"scratch", "train", "learner_ranks"} else TrainConfig


@pytest.mark.parametrize("name", configs_named())
def test_every_config_the_docs_name_exists_and_loads(name):
    path = REPO / name
    assert path.is_file(), f"{name} is named in README.md or docs/ but does not exist"
    load_config(path, [], root=root_of(path))


def relative_links(text: str) -> list[str]:
    """Targets of markdown links outside code (fenced blocks and `inline code`), without web ones; an
    in-page link is "#anchor"."""
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))
    targets = re.findall(r"\]\(([^)\s]+)\)", prose)
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def anchors(page) -> set[str]:
    """The anchors a page's headings get, as GitHub makes them: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_to_a_file_and_heading(page):
    broken = []
    for target in relative_links(page.read_text()):
        file, _, anchor = target.partition("#")
        path = page.parent / file if file else page
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: broken links {broken}"


def test_the_readme_opens_with_the_fresh_machine_commands_ci_runs():
    head = "\n".join((REPO / "README.md").read_text().splitlines()[:60])
    assert TRAIN in head and TEST in head
    assert TEST.split(" && ")[1] in (REPO / ".ci" / "run").read_text().splitlines()


def test_the_link_checker_sees_links_and_anchors_and_skips_code(tmp_path):
    text = "see [a](docs/a.md#x), [b](../configs/b.yaml), [web](https://x.org), [top](#t)\n"
    text += "`[c](c.md)`\n```\n[d](d.md)\n```"
    assert relative_links(text) == ["docs/a.md#x", "../configs/b.yaml", "#t"]
    page = tmp_path / "p.md"
    page.write_text("# Rewards and judges: `kind: judge`\n```\n# not a heading\n```\n## Step 2\n")
    assert anchors(page) == {"rewards-and-judges-kind-judge", "step-2"}
