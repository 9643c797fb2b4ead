import subprocess
import sys
from pathlib import Path

import pytest

from hyperserve.gateway.config import load_config, parse_config

EXAMPLE = Path(__file__).parents[2] / "examples" / "gateway.yaml"


def _config(**route) -> dict:
    return {"backends": [{"name": "a", "url": "http://127.0.0.1:1"}], "routes": [{"model": "m", **route}]}


def test_example_config_is_valid():
    config = load_config(EXAMPLE)
    assert [r.model for r in config.routes] == ["smollm2"]
    assert config.routes[0].balance == "prefix-affinity"


@pytest.mark.parametrize("route, message", [
    ({"backends": ["a"], "balanse": "x"}, "routes.0.balanse: Extra inputs are not permitted"),
    ({"backends": ["nope"]}, "routes.0.backends: unknown backend 'nope'"),
    ({"backends": ["a"], "balance": "random"}, "routes.0.balance"),
    ({}, "give exactly one of backends and cascade"),
    ({"cascade": {"models": ["m", "x"]}}, "routes.0.cascade.models: 'm' is not another route"),
    ({"backends": ["a"], "retries": -1}, "routes.0.retries"),
])
def test_invalid_route_names_the_offending_key(route, message):
    with pytest.raises(ValueError, match="invalid gateway config") as error:
        parse_config(_config(**route))
    assert message in str(error.value)


def test_backend_needs_exactly_one_source():
    with pytest.raises(ValueError, match="backends.0: Value error, give exactly one of url and local"):
        parse_config({"backends": [{"name": "a", "url": "http://x", "local": {}}], "routes": [{"model": "m",
                                                                                             "backends": ["a"]}]})


def test_cli_fails_at_start_with_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [{name: a, url: 'http://x'}]\nroutes: [{model: m, backends: [a]}]\ncache: {ttl: 5}\n")
    result = subprocess.run([sys.executable, "-m", "hyperserve.cli", "gateway", "--config", str(bad)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "cache.ttl: Extra inputs are not permitted" in result.stderr
