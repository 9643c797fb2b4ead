"""The `hyperserve` command's own handling, without a model."""

from __future__ import annotations

import json
import tempfile

import pytest

from hyperserve import cli


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("setting, message", [(["--temperature", "-1"], "temperature must be non-negative"),
                                              (["--max-tokens", "0"], "max_tokens must be at least 1")])
def test_a_bad_sampling_setting_fails_before_the_model_loads(monkeypatch, command, setting, message):
    def no_engine(args):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(cli, "_engine", no_engine)
    argv = [command, *(["Hi"] if command == "generate" else []), *setting]
    with pytest.raises(SystemExit, match=message):
        cli.main(argv)


def test_bench_exits_non_zero_when_no_request_succeeds(capsys):
    """A closed port: every request fails, the table is printed, and the exit status says so."""
    from tests.server.conftest import free_port

    with pytest.raises(SystemExit, match="no request succeeded"):
        cli.main(["bench", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-requests", "2"])
    assert "requests ok 0/2" in capsys.readouterr().out


def _batch_file(path, lines: list[tuple[str, dict]], url: str = "/v1/completions"):
    path.write_text("".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"
                            for custom_id, body in lines))
    return str(path)


def test_run_batch_answers_a_batch_file_in_order(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    prompts = ["The capital of France is", "One, two,", "Hello"]
    lines = [(f"p{i}", {"prompt": p, "max_tokens": 4, "temperature": 0}) for i, p in enumerate(prompts)]
    lines.insert(1, ("bad", {"prompt": "x", "max_tokens": -1}))
    source, target = _batch_file(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    cli.main(["run-batch", "-i", source, "-o", str(target), "--max-num-seqs", "2", "--kv-cache-memory-gb", "0.25",
              "--max-concurrency", "2"])
    results = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["p0", "bad", "p1", "p2"]
    assert [r["response"]["status_code"] for r in results] == [200, 400, 200, 200]
    assert all(r["response"]["body"]["choices"][0]["text"] for r in results if r["custom_id"] != "bad")
    assert "3 of 4 requests answered, 1 failed" in capsys.readouterr().err
    assert list((tmp_path / "tmp").iterdir()) == []  # the Batch API's files went with the app's shutdown


@pytest.mark.parametrize("urls", [["/v1/completions", "/v1/chat/completions"], ["/v1/moderations"]])
def test_run_batch_refuses_a_file_of_no_one_endpoint_before_loading_the_model(tmp_path, monkeypatch, urls):
    from hyperserve.engine import engine

    def no_engine(*args, **kwargs):
        raise AssertionError("the model was loaded before the file was checked")

    monkeypatch.setattr(engine.LLMEngine, "__init__", no_engine)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": str(i), "method": "POST", "url": url, "body": {}}) + "\n"
                            for i, url in enumerate(urls)))
    with pytest.raises(SystemExit, match="every line's url must be the same one of"):
        cli.main(["run-batch", "-i", str(path), "-o", str(tmp_path / "out.jsonl")])


def test_the_parser_choices_are_the_servers_own():
    """The CLI spells out --tool-call-parser and --reasoning-parser's choices (so that parsing flags
    imports nothing heavy); they must be the server's formats and parsers, no more, no fewer."""
    from hyperserve.server.reasoning import PARSERS
    from hyperserve.server.tools import FORMATS

    serve = cli.build_parser()._subparsers._group_actions[0].choices["serve"]
    choices = {a.dest: set(a.choices) for a in serve._actions if a.choices}
    assert choices["tool_call_parser"] == set(FORMATS) and choices["reasoning_parser"] == set(PARSERS)
