"""schemathesis fuzzes the OpenAPI schema of a real server and gateway: no response may be a 5xx
and none may hang. The CI-sized run; `benchmarks/fuzz.py` runs the 1,000-case one."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.gateway.conftest import running_stubs, start_gateway
from tests.server.conftest import start_server, stop_server

pytestmark = pytest.mark.slow


def fuzz(url: str, max_examples: int, phases: str = "fuzzing", seed: int = 1) -> tuple[int, str]:
    """Run schemathesis against `url`; (cases generated, its output). Fails on any 5xx or timeout."""
    binary = str(Path(sys.executable).with_name("schemathesis"))  # installed beside python by `make test`
    with tempfile.TemporaryDirectory() as cache:  # schemathesis keeps a cache in its working directory
        command = [binary, "run", f"{url}/openapi.json", "--checks", "not_a_server_error", "--phases", phases,
                   "-n", str(max_examples), "--request-timeout", "30", "--seed", str(seed)]
        run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cache)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    generated = re.search(r"(\d+) generated", run.stdout)
    return int(generated.group(1)) if generated else 0, run.stdout


def test_fuzzed_server_requests_never_get_a_5xx():
    server = start_server("--max-model-len", "64", "--kv-cache-memory-gb", "0.25", "--max-num-seqs", "4",
                          "--default-max-tokens", "8", "--embedding-model", "all-MiniLM-L6-v2",
                          log_name="fuzz")
    try:
        cases, _ = fuzz(server.url, max_examples=25)
        assert cases >= 100
        assert server.process.poll() is None
    finally:
        stop_server(server)


def test_fuzzed_gateway_requests_never_get_a_5xx(tmp_path):
    with running_stubs("a") as (stub,):
        config = {"backends": [{"name": "a", "url": stub.url}], "routes": [{"model": "m", "backends": ["a"]}],
                  "cache": {"enabled": False}}
        with start_gateway(config, tmp_path) as gateway:
            cases, _ = fuzz(gateway.url, max_examples=10)
            assert cases >= 20
