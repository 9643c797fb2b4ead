"""The playground and the dashboard in a real browser: Playwright driving Debian's headless
Chromium (installed by `make test`) against a real `hyperserve serve`. Screenshots of both pages
go to build/screenshots/ (README shows copies of them)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import start_server, stop_server

playwright_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
QUESTION = "Write a Python function that returns the square of a number."
SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "screenshots"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (make test installs Debian's)")]


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"the page threw: {errors}"


def settings(page, **values) -> None:
    for name, value in values.items():
        page.fill(f"#{name}", str(value))


def send(page, text: str):
    """Types `text` and presses Enter; the assistant's message (a locator)."""
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    return page.locator("#messages li.assistant").last


def test_the_playground_streams_an_answer_with_its_timings(server, page):
    page.goto(server.url)  # / leads to the playground
    page.wait_for_selector("#model option[value=smollm2-135m]", state="attached")
    settings(page, temperature=0, max_tokens=96)
    answer = send(page, QUESTION)
    stats = answer.locator(".stats")
    playwright_api.expect(stats).to_contain_text("TTFT", timeout=30_000)
    playwright_api.expect(stats).to_contain_text("tok/s")
    playwright_api.expect(stats).to_contain_text("cached")
    # What the page streamed and kept is the server's own greedy answer to the same request.
    kept = page.evaluate("JSON.parse(localStorage.getItem('hyperserve.conversation'))")
    reference = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "smollm2-135m", "temperature": 0, "max_tokens": 96,
        "messages": [{"role": "user", "content": QUESTION}]}).json()
    assert kept[-1]["content"] == reference["choices"][0]["message"]["content"]
    assert answer.locator(".content").inner_text().strip()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "playground.png")
    page.reload()  # the conversation is kept in the browser
    playwright_api.expect(page.locator("#messages li.user")).to_have_text(QUESTION)


def test_a_changed_parameter_reaches_the_server(server, page):
    page.goto(f"{server.url}/ui/")
    page.click("#clear")
    settings(page, temperature=0, max_tokens=3)
    answer = send(page, "Write a long story about a dragon.")
    playwright_api.expect(answer.locator(".stats")).to_contain_text("3 tokens", timeout=30_000)


def test_stop_ends_generation_and_frees_the_kv_cache(server, page):
    page.goto(f"{server.url}/ui/")
    page.click("#clear")
    settings(page, temperature=0, max_tokens=1500)
    answer = send(page, "Count from 1 to 1000, one number per line.")
    playwright_api.expect(answer.locator(".content")).not_to_be_empty(timeout=30_000)
    page.click("#stop-button")
    playwright_api.expect(answer.locator(".stats")).to_contain_text("stopped", timeout=10_000)
    playwright_api.expect(page.locator("#send")).to_be_visible()
    server.wait_idle()  # the request was aborted and its KV blocks are back in the pool


def test_the_dashboard_charts_move_under_load(server, page):
    page.goto(f"{server.url}/ui/dashboard.html")
    throughput = page.locator("section.chart[aria-label='Throughput (tokens/s)']")
    playwright_api.expect(throughput).to_be_visible()

    def load() -> None:
        body = {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}
        with httpx.Client(timeout=60) as client:
            for _ in range(6):
                client.post(f"{server.url}/v1/completions", json=body)

    workers = [threading.Thread(target=load) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        chart = "document.querySelector(\"section.chart[aria-label='{}']\").dataset.points"
        page.wait_for_function(chart.format("Throughput (tokens/s)") + " > 2", timeout=60_000)
        page.wait_for_function(chart.format("Time to first token (ms)") + " > 0", timeout=30_000)
    finally:
        for worker in workers:
            worker.join()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "dashboard.png")


def test_the_batches_page_runs_a_file_and_downloads_its_results(server, page, tmp_path):
    """Upload, start, follow to completed, download the output: the server's own answers."""
    import json

    questions = ["Name a colour.", "Name a fruit.", "Name a river."]
    source = tmp_path / "questions.jsonl"
    source.write_text("".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                                          "body": {"prompt": q, "max_tokens": 8, "temperature": 0}}) + "\n"
                              for i, q in enumerate(questions)))
    page.goto(f"{server.url}/ui/batches.html")
    playwright_api.expect(page.locator("#updated")).not_to_be_empty()
    rows = page.locator("#batches tr")
    before = rows.count()  # the shared server may hold other tests' batches: the newest row is first
    page.set_input_files("#file", str(source))
    page.select_option("#endpoint", "/v1/completions")
    page.click("#start")
    playwright_api.expect(rows).to_have_count(before + 1)
    row = rows.first
    playwright_api.expect(row).to_have_attribute("data-status", "completed", timeout=60_000)
    playwright_api.expect(row.locator("td").nth(3)).to_contain_text("3 / 3")
    with page.expect_download() as download:
        row.get_by_role("button", name="Output").click()
    lines = [json.loads(line) for line in Path(download.value.path()).read_text().splitlines()]
    for line, question in zip(lines, questions):
        alone = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"prompt": question, "max_tokens": 8, "temperature": 0}).json()
        assert line["response"]["body"]["choices"][0]["text"] == alone["choices"][0]["text"]
    page.set_input_files("#file", str(tmp_path / "questions.jsonl"))
    page.select_option("#endpoint", "/v1/embeddings")  # the file's lines name another endpoint
    page.click("#start")
    playwright_api.expect(rows).to_have_count(before + 2)
    failed = rows.first
    playwright_api.expect(failed).to_have_attribute("data-status", "failed", timeout=30_000)
    assert "url must be the batch's endpoint" in failed.locator("td").nth(2).get_attribute("title")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "batches.png")


def test_with_keys_on_the_pages_ask_for_one_and_stream_with_it(browser):
    context = browser.new_context()
    keyed = start_server("--kv-cache-memory-gb", "0.25", "--api-key", "browser-secret", log_name="ui-keys")
    try:
        page = context.new_page()
        page.goto(f"{keyed.url}/ui/")
        dialog = page.locator("#key-dialog")
        playwright_api.expect(dialog).to_be_visible()
        dialog.locator("input").fill("browser-secret")
        dialog.locator("button").click()
        page.wait_for_selector("#model option[value=smollm2-135m]", state="attached")
        settings(page, temperature=0, max_tokens=8)
        answer = send(page, "Write a story about a dragon.")  # over the WebSocket, the key as its subprotocol
        playwright_api.expect(answer.locator(".stats")).to_contain_text("8 tokens", timeout=30_000)
        assert httpx.get(f"{keyed.url}/stats").status_code == 401  # the dashboard's data needs the key too
    finally:
        context.close()
        stop_server(keyed)


def test_a_narrow_window_stacks_the_settings_above_the_chat(server, page):
    page.set_viewport_size({"width": 420, "height": 800})
    page.goto(f"{server.url}/ui/")
    page.click("#clear")
    settings(page, temperature=0, max_tokens=4)
    aside, chat = page.locator("aside").bounding_box(), page.locator("section.chat").bounding_box()
    assert chat["y"] >= aside["y"] + aside["height"] - 1 and chat["width"] > 380
    answer = send(page, "Hi")
    playwright_api.expect(answer.locator(".stats")).to_contain_text("4 tokens", timeout=30_000)
