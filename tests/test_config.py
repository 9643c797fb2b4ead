"""Engine configuration: what the fields take, and the clear errors they give."""

from __future__ import annotations

import pytest

from hyperserve.config import ModelConfig

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"


def test_a_chat_template_is_read_from_its_file_or_taken_as_given(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert ModelConfig(chat_template=str(path)).chat_template == TEMPLATE
    assert ModelConfig(chat_template=TEMPLATE).chat_template == TEMPLATE


@pytest.mark.parametrize("value, says", [
    ("/no/such/template.jinja", "no file '/no/such/template.jinja'"),
    ("{% for m in messages %}{{ m.content }}", "line 1"),  # the loop never ends
])
def test_a_chat_template_that_cannot_be_used_fails_at_start(value, says):
    with pytest.raises(ValueError, match=says):
        ModelConfig(chat_template=value)
