from __future__ import annotations

import pytest

from hyperserve.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("text", ["héllo wörld, naïve café", "emoji 😀🎉 and 日本語のテキスト", " leading space"])
def test_incremental_text_equals_full_decode_and_never_shows_broken_characters(smollm2_tokenizer, text):
    ids = smollm2_tokenizer(text).input_ids
    detok = IncrementalDetokenizer(smollm2_tokenizer, [1, 2, 3], stop=[])
    for token_id in ids:
        detok.add_token(token_id)
        assert "\ufffd" not in detok.output_text(False)
    assert detok.output_text(True) == smollm2_tokenizer.decode(ids)


def test_partial_stop_string_is_held_back_until_it_cannot_match(smollm2_tokenizer):
    ids = smollm2_tokenizer("alpha beta gamma").input_ids
    detok = IncrementalDetokenizer(smollm2_tokenizer, [], stop=["beta gamma"])
    stopped = [detok.add_token(t) for t in ids]
    assert stopped[-1] and not any(stopped[:-1])
    assert detok.output_text(True) == "alpha "
