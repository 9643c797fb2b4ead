from __future__ import annotations

from hyperserve.gateway.backends import _redacted


def test_secret_flags_never_reach_the_log():
    command = ["python", "-m", "hyperserve.cli", "serve", "--api-key", "hs-123", "--model", "m", "--api-key=hs-456"]
    shown = " ".join(_redacted(command))
    assert "hs-123" not in shown and "hs-456" not in shown
    assert shown == "python -m hyperserve.cli serve --api-key *** --model m --api-key=***"
