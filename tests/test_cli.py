"""The `hyperserve` command's own handling, without a model."""

from __future__ import annotations

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
