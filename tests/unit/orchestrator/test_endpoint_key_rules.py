"""The config refuses an agent endpoint that listens beyond loopback without a key (RELAY_ENDPOINT_KEY),
at launch, before Ray starts: whoever reached it could post rewards that train the policy."""

import pytest

from orchestrator.config.load import ConfigError, load_config
from tests.helpers import REPO
from tests.unit.orchestrator.test_config import ENDPOINT  # a valid endpoint run of the grpo preset

GRPO = REPO / "configs" / "grpo_tiny_cpu.yaml"
REFUSED = r"rollout.endpoint.host: listening on .* set the environment variable RELAY_ENDPOINT_KEY"


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "gpu-node-7"])
def test_an_endpoint_beyond_loopback_needs_a_key_named_in_the_error(host, monkeypatch):
    monkeypatch.delenv("RELAY_ENDPOINT_KEY", raising=False)
    with pytest.raises(ConfigError, match=REFUSED):
        load_config(GRPO, [*ENDPOINT, f"rollout.endpoint.host={host}"])
    monkeypatch.setenv("RELAY_ENDPOINT_KEY", "s3cret-key")
    assert load_config(GRPO, [*ENDPOINT, f"rollout.endpoint.host={host}"]).rollout.endpoint.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_an_endpoint_on_loopback_needs_no_key(host, monkeypatch):
    monkeypatch.delenv("RELAY_ENDPOINT_KEY", raising=False)
    assert load_config(GRPO, [*ENDPOINT, f"rollout.endpoint.host={host}"]).rollout.endpoint.host == host
