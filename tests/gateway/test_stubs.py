"""The stub backends the gateway, security and reliability tests start leave no process behind,
however their fixture ends (a run once left a stub backend running)."""

from __future__ import annotations

import socket

import pytest

from tests.gateway import conftest
from tests.gateway.conftest import running_stubs


def test_a_stub_that_fails_to_start_stops_those_started_before_it(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([conftest.free_port(), taken.getsockname()[1]])  # the second stub cannot bind its port
    monkeypatch.setattr(conftest, "free_port", lambda: next(ports))
    started = []
    monkeypatch.setattr(conftest.Stub, "start", _recording(conftest.Stub.start, started))
    with pytest.raises(RuntimeError, match="exited"), running_stubs("a", "b"):
        pass
    taken.close()
    assert len(started) == 2 and all(stub.process.poll() is not None for stub in started)


def test_every_stub_is_stopped_when_the_block_fails():
    with pytest.raises(RuntimeError, match="the test failed"), running_stubs("a", "b") as stubs:
        raise RuntimeError("the test failed")
    assert all(stub.process.poll() is not None for stub in stubs)


def _recording(start, started: list):
    def record(stub):
        started.append(stub)
        return start(stub)
    return record
