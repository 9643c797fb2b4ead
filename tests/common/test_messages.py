from __future__ import annotations

import pytest

from hyperserve.common.messages import message_text, text_parts


def test_strings_parts_and_none():
    assert message_text("hi") == "hi" and message_text(None) == ""
    assert message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], separator=" ") == "a b"


@pytest.mark.parametrize("content", [5, {"text": "x"}, [{"type": "text", "text": 5}], [{"type": "image_url"}],
                                     ["hi"], [{"text": "no type"}], [[{"type": "text", "text": "nested"}]]])
def test_strictly_anything_but_text_is_a_value_error(content):
    with pytest.raises(ValueError):
        text_parts(content)


def test_leniently_what_is_not_text_is_skipped():
    content = [{"type": "text", "text": "keep"}, {"type": "text", "text": 5}, {"type": "image_url"}, "stray"]
    assert text_parts(content, strict=False) == ["keep"]
    assert text_parts(5, strict=False) == []
