"""Deployment recipes: the cluster files checked (a real `ray job submit` to two nodes:
tests/e2e/deploy/test_multinode.py)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.config.load import load_config
from tests.helpers import REPO

RAY = str(Path(sys.executable).with_name("ray"))


def configs_named_in(text: str) -> list[str]:
    return sorted(set(re.findall(r"configs/[\w.\-]+\.yaml", text)))


@pytest.mark.parametrize("name", ["README.md", "kuberay-rayjob.yaml", "slurm.sbatch"])
def test_every_config_a_recipe_names_exists_and_loads(name):
    found = configs_named_in((REPO / "deploy" / name).read_text())
    assert found, name
    for path in found:
        assert load_config(REPO / path, ["cluster.address=auto"]).cluster.address == "auto"


def test_kuberay_manifest_is_a_rayjob():
    job = yaml.safe_load((REPO / "deploy" / "kuberay-rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["apiVersion"].startswith("ray.io/")
    assert job["spec"]["entrypoint"].startswith("relay train configs/")
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert workers[0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]


def test_slurm_script_parses():
    assert subprocess.run(["bash", "-n", str(REPO / "deploy" / "slurm.sbatch")]).returncode == 0


def test_every_recipe_starts_ray_with_token_authentication():
    """Whoever can submit a Ray job runs code on every node: no recipe turns Ray's authentication off,
    and each sets RAY_AUTH_MODE=token with a token for every Ray process it starts (Ray 2.60's scheme)."""
    texts = {
        name: (REPO / "deploy" / name).read_text() for name in ("README.md", "kuberay-rayjob.yaml", "slurm.sbatch")
    }
    texts["README.md"] = "".join(re.findall(r"```bash\n(.*?)```", texts["README.md"], re.S))  # its commands
    for name, text in texts.items():
        assert not re.search(r"RAY_AUTH_MODE\W*(=|value:)\s*disabled", text), name
    assert re.search(r"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=\$\(", texts["README.md"])
    assert "export RAY_AUTH_MODE=token" in texts["slurm.sbatch"] and "export RAY_AUTH_TOKEN" in texts["slurm.sbatch"]
    spec = yaml.safe_load(texts["kuberay-rayjob.yaml"])["spec"]
    cluster = spec["rayClusterSpec"]
    pods = [spec["submitterPodTemplate"], cluster["headGroupSpec"]["template"]]
    pods += [group["template"] for group in cluster["workerGroupSpecs"]]
    for pod in pods:  # the head, every worker and the pod that runs `ray job submit`
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "relay-ray-token"
