from pathlib import Path

import pytest

from hyperserve.security.config import hash_key, load_security_config

EXAMPLE = Path(__file__).parents[2] / "examples" / "security.yaml"


def test_example_config_is_valid_and_bare_off_means_off():
    config = load_security_config(EXAMPLE)
    assert config.keys[0].sha256 == hash_key("user1")
    assert config.guardrails.pii_response == "off"  # written `off`, which YAML reads as false


def test_single_api_key_is_stored_hashed():
    config = load_security_config(None, api_key="s3cret")
    assert [(k.name, k.sha256) for k in config.keys] == [("default", hash_key("s3cret"))]
    assert "s3cret" not in config.model_dump_json()


@pytest.mark.parametrize("text, message", [
    ("keys: [{name: a, sha256: abc}]", "keys.0.sha256"),
    ("defaults: {requests_per_minit: 5}", "defaults.requests_per_minit: Extra inputs are not permitted"),
    ("guardrails: {injection: redact}", "guardrails.injection"),
])
def test_invalid_config_names_the_key(tmp_path, text, message):
    path = tmp_path / "security.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="invalid security config") as error:
        load_security_config(path)
    assert message in str(error.value)
