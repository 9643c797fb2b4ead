"""Real processes for the gateway tests: stub backends and gateways on loopback."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.server.conftest import free_port

STUB = str(Path(__file__).with_name("stub_backend.py"))


def wait_http(url: str, process: subprocess.Popen, timeout: float = 60, status: int = 200) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer {status}")


@dataclass
class Stub:
    name: str
    port: int
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Stub:
        """Started and answering; one that does not answer in time is killed before the error."""
        self.process = subprocess.Popen([sys.executable, STUB, "--port", str(self.port), "--name", self.name])
        try:
            wait_http(f"{self.url}/health", self.process)
        except BaseException:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def control(self, **changes) -> None:
        httpx.post(f"{self.url}/control", json=changes).raise_for_status()

    @property
    def count(self) -> int:
        return httpx.get(f"{self.url}/stats").json()["count"]


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def chat(self, content: str, model: str = "m", system: str | None = None, api_key: str | None = None,
             **params) -> httpx.Response:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": content})
        body = {"model": model, "messages": messages, "temperature": 0, **params}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=60)

    def metric(self, name: str, **labels) -> float:
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(f"hyperserve:{name}") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def start_gateway(config: dict, tmp_path: Path, name: str = "gateway", args: tuple[str, ...] = ()) -> Gateway:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp_path / f"{name}-{port}.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "hyperserve.cli", "gateway", "--config", str(path),
                                "--port", str(port), "--quiet", *args], stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    gateway = Gateway(f"http://127.0.0.1:{port}", process)
    try:
        wait_http(f"{gateway.url}/health", process, timeout=300)
    except BaseException:
        gateway.stop()
        raise
    return gateway


@contextlib.contextmanager
def running_stubs(*names: str) -> Iterator[list[Stub]]:
    """Stub backends of these names, each killed on exit however the block ends: one that fails to
    start kills those before it, and a stub a test put in the list in place of another (started
    again on its port) is killed too."""
    started: list[Stub] = []
    try:
        for name in names:
            started.append(Stub(name, free_port()).start())
        yield started
    finally:
        for stub in started:
            stub.kill()


@pytest.fixture
def stubs():
    with running_stubs("a", "b") as started:
        yield started
