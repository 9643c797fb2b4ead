"""`hyperserve serve --semantic-cache`: the gateway's cache in front of the server's own engine."""

import json
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import start_server, stop_server

pytestmark = pytest.mark.slow


def temporary_directories() -> set[Path]:
    """The servers' own temporary directories: the Batch API's files, the engine's socket."""
    return {path for path in Path(tempfile.gettempdir()).glob("hyperserve-*") if path.is_dir()}


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("files")


@pytest.fixture(scope="module")
def cached_server(tmp_path_factory, files_dir):
    path = tmp_path_factory.mktemp("response-cache") / "cache.sqlite"
    before = temporary_directories()
    server = start_server("--semantic-cache", "--response-cache-path", str(path), "--kv-cache-memory-gb",
                          "0.5", "--files-dir", str(files_dir), log_name="semantic-cache")
    try:
        assert len(temporary_directories() - before) == 1  # the engine's socket's: the files go to files_dir
        yield server
    finally:  # stopped even where the assertion fails: a failing fixture must not leave a server running
        stop_server(server)
    assert temporary_directories() == before  # a SIGTERM-stopped server leaves none behind


def _ask(url: str, content: str, stream: bool = False) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 12,
            "stream": stream}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def _streamed_text(response: httpx.Response) -> str:
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_paraphrase_is_answered_from_the_cache_with_the_engines_answer(cached_server):
    url = cached_server.url
    miss = _ask(url, "What's the capital of France?", stream=True)
    assert miss.headers["x-hyperserve-cache"] == "miss"
    answer = _streamed_text(miss)
    assert answer
    generated = cached_server.metric("generation_tokens_total")
    hit = _ask(url, "Tell me France's capital city")
    assert hit.headers["x-hyperserve-cache"] == "hit-semantic"
    assert hit.json()["choices"][0]["message"]["content"] == answer
    streamed_hit = _ask(url, "Tell me France's capital city", stream=True)
    assert _streamed_text(streamed_hit) == answer
    assert cached_server.metric("generation_tokens_total") == generated  # the engine did no work for the hits


def test_engine_endpoints_pass_through(cached_server):
    prompt = "You are a helpful assistant who answers in one short sentence. " * 4  # several KV blocks
    pinned = httpx.post(f"{cached_server.url}/v1/cache", json={"prompt": prompt, "ttl": 30})
    assert pinned.status_code == 200
    cached = pinned.json()["cached_tokens"]
    assert cached >= 32 and cached % 16 == 0  # the prompt's whole blocks, held by the engine behind
    deleted = httpx.delete(f"{cached_server.url}/v1/cache/{pinned.json()['id']}")
    assert deleted.json()["deleted"] is True
    assert httpx.delete(f"{cached_server.url}/v1/cache/nope").status_code == 404


def test_stats_show_the_gateway_and_the_engine_behind_it(cached_server):
    """The dashboard of `serve --response-cache` charts both: the cache's outcomes and the engine."""
    samples = httpx.get(f"{cached_server.url}/stats").json()["samples"]
    assert "hyperserve:gateway_requests_total" in samples
    assert samples["hyperserve:num_requests_running"][0]["labels"] == {"model_name": "smollm2-135m"}
    assert httpx.get(f"{cached_server.url}/ui/kind.json").json() == {"kind": "gateway"}


def test_its_dashboard_charts_the_cache_and_the_engine(cached_server):
    from tests.server.test_web_ui import CHROMIUM, playwright_api

    if CHROMIUM is None:
        pytest.skip("no Chromium here (make test installs Debian's)")
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(f"{cached_server.url}/ui/dashboard.html")
        for title in ("Requests/s by cache outcome", "Throughput (tokens/s)", "KV cache (% of the pool)"):
            playwright_api.expect(page.locator(f"section.chart[aria-label='{title}']")).to_be_visible()
        browser.close()


def test_uploaded_files_are_kept_in_the_files_dir(cached_server, files_dir):
    """The front's Batch API answers /v1/files, so it, not the engine behind it, keeps them there."""
    upload = httpx.post(f"{cached_server.url}/v1/files", files={"file": ("in.jsonl", b"{}\n")},
                        data={"purpose": "batch"}, timeout=30)
    assert upload.status_code == 200, upload.text
    assert (files_dir / upload.json()["id"]).read_bytes() == b"{}\n"
