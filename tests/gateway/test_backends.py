from __future__ import annotations

from hyperserve.gateway.backends import _redacted


def test_secret_flags_never_reach_the_log():
    command = ["python", "-m", "hyperserve.cli", "serve", "--api-key", "hs-123", "--model", "m", "--api-key=hs-456"]
    shown = " ".join(_redacted(command))
    assert "hs-123" not in shown and "hs-456" not in shown
    assert shown == "python -m hyperserve.cli serve --api-key *** --model m --api-key=***"


def test_a_local_backend_of_several_models_passes_each_routes_model_through(monkeypatch):
    import asyncio

    from hyperserve.gateway import backends
    from hyperserve.gateway.config import BackendConfig, BreakerConfig, LocalModel

    launched = []
    monkeypatch.setattr(backends.subprocess, "Popen", lambda command, **_: launched.append(command))

    async def build(args: list[str]):
        backend = backends.build_backend(BackendConfig(name="e", local=LocalModel(args=args)), BreakerConfig())
        await backend.session.close()
        return backend

    assert asyncio.run(build([])).model == "smollm2-135m"  # one model: requests name it
    assert asyncio.run(build(["--model", "gemma3-270m"])).model is None  # several: the route's name goes through
    assert launched[1][-2:] == ["--model", "gemma3-270m"]
