"""A real `hyperserve serve` process on loopback, shared by the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    statuses_while_loading: list[int]

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        for line in text.splitlines():
            if line.startswith(f"hyperserve:{name}{{") or line.startswith(f"hyperserve:{name} "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_idle(self, timeout: float = 20) -> None:
        """Until no request runs or waits and the KV pool is empty again."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.metric("num_requests_running") == 0 and self.metric("kv_cache_usage_perc") == 0:
                return
            time.sleep(0.1)
        raise AssertionError("server did not return to idle")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*flags: str, log_name: str = "server") -> Server:
    port = free_port()
    log = open(os.path.join(os.environ.get("PYTEST_TMP", "/tmp"), f"hyperserve-{log_name}-{port}.log"), "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "hyperserve.cli", "serve", "--port", str(port), *flags],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    statuses = []
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}; see {log.name}")
            try:
                status = httpx.get(f"{url}/health", timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            statuses.append(status)
            if status == 200:
                return Server(process, url, statuses)
            time.sleep(0.2)
        raise RuntimeError("server did not become healthy")
    except BaseException:  # not healthy in time, or the test run interrupted: no server left behind
        process.kill()
        process.wait()
        raise


def serve_in_process(app, timeout: float = 60):
    """A TestClient of an app, its lifespan entered and /health answering 200 (the caller exits it)."""
    from fastapi.testclient import TestClient

    client = TestClient(app)
    client.__enter__()
    deadline = time.time() + timeout
    while client.get("/health").status_code != 200:
        assert time.time() < deadline, "the app did not become healthy"
        time.sleep(0.05)
    return client


def stop_server(server: Server) -> None:
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()


@pytest.fixture(scope="session")
def server():
    s = start_server("--kv-cache-memory-gb", "0.5", "--max-num-seqs", "4", "--max-queue", "4",
                     "--embedding-model", "all-MiniLM-L6-v2",
                     "--max-body-bytes", "100000")
    yield s
    stop_server(s)


def save_scripted_model(tokenizer, links: list[tuple[int, int]], eos_token_id, path) -> str:
    """A one-layer Llama that answers by script: its layers add nothing, so each next token depends
    on the last one alone, and the LM head maps each `links` pair's first token to its second.
    Saved with `tokenizer` at `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=eos_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.model.norm, model.model.layers[0].input_layernorm,
                     model.model.layers[0].post_attention_layernorm):
            norm.weight.fill_(1.0)
        embedding = torch.nn.functional.normalize(torch.randn(len(tokenizer), 64, generator=torch.Generator()
                                                              .manual_seed(0)), dim=-1)
        model.model.embed_tokens.weight.copy_(embedding)
        for current, following in links:
            model.lm_head.weight[following] = 30 * embedding[current]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)

