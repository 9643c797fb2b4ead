import random

import pytest

from hyperserve.security.pii import Redactor, StreamRedactor, find_pii

SECRETS = {
    "EMAIL": "jane.roe@example.org", "PHONE": "+44 20 7946 0958", "CARD": "4111 1111 1111 1111",
    "IBAN": "DE89 3704 0044 0532 0130 00", "IP": "10.20.30.40", "API_KEY": "sk-proj-" + "Ab3" * 20,
}
TEXT = ("Contact jane.roe@example.org or +44 20 7946 0958. Pay with 4111 1111 1111 1111 or to "
        "DE89 3704 0044 0532 0130 00. The box is 10.20.30.40 and the key is sk-proj-" + "Ab3" * 20 + ". Thanks!")


def test_every_kind_is_found_with_its_checks():
    assert {f.kind: f.text for f in find_pii(TEXT)} == SECRETS
    assert find_pii("card 4111 1111 1111 1112") == []  # fails Luhn
    assert "IBAN" not in {f.kind for f in find_pii("IBAN DE89 3704 0044 0532 0130 01")}  # fails mod-97
    assert find_pii("in 1999 we sold 12 units at 300.5 each") == []
    assert [f.kind for f in find_pii("AKIAIOSFODNN7EXAMPLE and ghp_" + "x" * 36)] == ["API_KEY", "API_KEY"]


def test_redaction_uses_stable_placeholders_and_is_reversible():
    redactor = Redactor()
    redacted = redactor.redact(TEXT + " Again: jane.roe@example.org")
    assert not any(secret in redacted for secret in SECRETS.values())
    assert redacted.count("[EMAIL_1]") == 2
    assert redactor.restore(redacted) == TEXT + " Again: jane.roe@example.org"


@pytest.mark.parametrize("seed", range(20))
def test_streamed_redaction_never_emits_a_secret_split_across_chunks(seed):
    rng = random.Random(seed)
    text = TEXT * 3
    redactor = Redactor()
    stream = StreamRedactor(lambda piece, findings: redactor.redact(piece, findings))
    emitted, position = [], 0
    while position < len(text):
        size = rng.randint(1, 9)
        emitted.append(stream.feed(text[position:position + size]))
        position += size
    emitted.append(stream.flush())
    joined = "".join(emitted)
    assert not any(secret in joined for secret in SECRETS.values())
    assert joined == Redactor().redact(text)  # the same as redacting the whole text at once


def test_a_stream_without_spaces_is_emitted_as_it_comes_not_at_the_end():
    text = ("请联系张伟，邮箱jane.roe@example.org，电话13812345678。"
            + "我们明天上午十点在会议室见面，讨论下季度的计划。" * 6 + "卡号4111111111111111。")
    assert {f.kind for f in find_pii(text)} == {"EMAIL", "PHONE", "CARD"}
    redactor = Redactor()
    stream = StreamRedactor(lambda piece, findings: redactor.redact(piece, findings))
    emitted = [stream.feed(text[i:i + 2]) for i in range(0, len(text), 2)]
    assert len("".join(emitted)) > len(text) // 2  # most of it before the end
    joined = "".join(emitted) + stream.flush()
    assert joined == Redactor().redact(text)
    assert "jane.roe" not in joined and "13812345678" not in joined and "4111111111111111" not in joined


@pytest.mark.timeout(20)
@pytest.mark.parametrize("text", [
    "a." * 2_000_000,  # quadratic for the e-mail pattern under backtracking
    "1::" + "a" * 40 + "g",  # exponential for the IPv6 pattern under backtracking (hours at 40)
    "x@y.co " * 200_000,  # 200,000 findings: merged, not compared pairwise
])
def test_hostile_texts_are_scanned_in_linear_time(text):
    findings = find_pii(text)
    assert all(a.end <= b.start for a, b in zip(findings, findings[1:]))
