from __future__ import annotations

import pytest

from hyperserve.common.sse import DONE, EventSplitter, parse_sse_chunk, parse_sse_data, sse_chunks, sse_event


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


def test_a_stream_cut_anywhere_gives_the_same_whole_events():
    """Chunks end mid-event, mid-line and mid-character: the events come out whole and in order,
    each once, and what is left at the end is the last one."""
    stream = "".join(sse_event({"text": f"ü{i}"}) for i in range(5)).encode() + b"data: [DONE]"
    for size in (1, 3, 7, 64, len(stream)):
        splitter = EventSplitter()
        pieces = [stream[i : i + size] for i in range(0, len(stream), size)]
        events = [e for piece in pieces[:-1] for e in splitter.feed(piece)]
        events += splitter.feed(pieces[-1], final=True)
        assert events == [sse_event({"text": f"ü{i}"}).encode()[:-2] for i in range(5)] + [b"data: [DONE]"]
        assert sse_chunks(events) == [{"text": f"ü{i}"} for i in range(5)]
