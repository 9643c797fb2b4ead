"""One real `hyperserve serve` on SmolLM2 for the reliability tests, with small limits so they bite."""

from __future__ import annotations

import pytest

from tests.server.conftest import start_server, stop_server


@pytest.fixture(scope="session")
def hostile_server():
    s = start_server("--kv-cache-memory-gb", "0.25", "--max-num-seqs", "4", "--max-queue", "16",
                     "--max-body-bytes", "200000", "--max-model-len", "2048", "--max-pin-ttl-s", "600",
                     log_name="reliability")
    yield s
    stop_server(s)
