from __future__ import annotations

import pytest

from hyperserve.common.sse import DONE, parse_sse_chunk, parse_sse_data, sse_event


def test_events_round_trip():
    chunk = {"id": "x", "choices": [{"index": 0, "text": "a\nb"}]}
    line = sse_event(chunk).strip()
    assert parse_sse_chunk(line) == chunk
    assert sse_event(DONE) == "data: [DONE]\n\n" and parse_sse_chunk("data: [DONE]") is None


@pytest.mark.parametrize("line", ["", ": keep-alive", "event: ping", "data: [1, 2]", "data: 5"])
def test_lines_that_are_not_chunk_objects_give_none(line):
    assert parse_sse_chunk(line) is None


def test_data_without_a_space_is_data():
    assert parse_sse_data('data:{"a": 1}') == '{"a": 1}'


def test_a_payload_that_is_not_json_is_a_value_error():
    with pytest.raises(ValueError):
        parse_sse_chunk("data: {broken")
