"""LoRA adapters through the OpenAI API (in process, a tiny model): `model` names the adapter and
the answer is the adapter's; /v1/models lists adapters under their base; adapters load and
unload at run time from the configured folder only; an unusable adapter is a 400."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from hyperserve import LLM, LoRARequest, SamplingParams
from hyperserve.engine.engine import LLMEngine
from hyperserve.server.app import build_app
from hyperserve.server.model_pool import ModelEntry
from hyperserve.server.settings import ServerSettings
from tests.engine.test_lora import ENGINE, base, make_adapter  # noqa: F401 (base is a fixture)
from tests.server.conftest import serve_in_process

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def lora_dir(base, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(("alpha", "beta")):
        make_adapter(base, root / name, seed=i)
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text(json.dumps({"r": 4}))
    return root


@pytest.fixture(scope="module")
def client(base, lora_dir):  # noqa: F811
    adapters = {"alpha": LoRARequest("alpha", 1, str(lora_dir / "alpha")),
                "broken": LoRARequest("broken", 2, str(lora_dir / "broken"))}
    entry = ModelEntry("tiny", lambda: LLMEngine.from_kwargs(model=base, **ENGINE), adapters=adapters)
    client = serve_in_process(build_app([entry], ServerSettings(model_name="tiny"), lora_dir=lora_dir))
    yield client
    client.__exit__(None, None, None)


def _offline(base: str, lora: LoRARequest | None) -> list[float]:  # noqa: F811
    llm = LLM(model=base, **ENGINE)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0),
                       use_tqdm=False, lora_request=lora)[0].outputs[0]
    return [entries[t].logprob for t, entries in zip(out.token_ids, out.logprobs)]


def _answer(client: TestClient, model: str) -> list[float]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return response.json()["choices"][0]["logprobs"]["token_logprobs"]


def test_model_names_the_adapter_and_the_answer_is_the_adapters(client, base, lora_dir):  # noqa: F811
    alpha = LoRARequest("alpha", 1, str(lora_dir / "alpha"))
    assert _answer(client, "alpha") == pytest.approx(_offline(base, alpha), abs=1e-5)
    assert _answer(client, "tiny") == pytest.approx(_offline(base, None), abs=1e-5)
    cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert cards["alpha"]["parent"] == "tiny" and cards["alpha"]["root"].endswith("alpha")
    metrics = client.get("/metrics").text
    assert 'hyperserve:lora_adapters_loaded{model_name="tiny"} 1.0' in metrics
    assert 'hyperserve:lora_adapter_loads_total{model_name="tiny"} 1.0' in metrics
    hits = 'hyperserve:lora_adapter_hits_total{model_name="tiny",tier="%s"} %s'
    assert hits % ("memory", "1.0") in metrics and hits % ("step", "5.0") in metrics  # a prefill, 5 decodes
    assert hits % ("disk", "0.0") in metrics  # read at its check, before its first step


def test_an_unusable_adapter_is_a_400_and_the_server_goes_on(client):
    response = client.post("/v1/completions", json={"model": "broken", "prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 400 and "adapter_model.safetensors" in response.json()["error"]["message"]
    _answer(client, "alpha")


def test_adapters_load_at_run_time_from_the_lora_dir_only(client, lora_dir, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    refused = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(outside)})
    assert refused.status_code == 400 and "--lora-dir" in refused.json()["error"]["message"]
    escape = client.post("/v1/load_lora_adapter",
                         json={"lora_name": "x", "lora_path": str(lora_dir / ".." / "x")})
    assert escape.status_code == 400
    for path in (lora_dir / ("x" * 4000), f"{lora_dir}/a\x00b"):  # a name too long to look up, a NUL byte
        strange = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)})
        assert strange.status_code == 400, strange.text
    loaded = client.post("/v1/load_lora_adapter",
                         json={"lora_name": "beta", "lora_path": str(lora_dir / "beta")})
    assert loaded.status_code == 200, loaded.text
    assert _answer(client, "beta") != pytest.approx(_answer(client, "alpha"), abs=1e-3)
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "beta"}).status_code == 200
    gone = client.post("/v1/completions", json={"model": "beta", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404


def test_an_adapter_loaded_again_is_read_afresh_and_its_old_kv_is_not_reused(
        client, base, lora_dir):  # noqa: F811
    """Fine-tuning loops write new weights where the old ones were and load them again under the
    same name: the second load must answer with the new weights, not the first load's (still in
    memory), nor its KV in the prefix cache (a prompt longer than a block hits it)."""
    import shutil

    def answer(model: str, prompt: list[int]) -> list[float]:
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["logprobs"]["token_logprobs"]

    def offline(adapter: str, prompt: list[int]) -> list[float]:
        llm = LLM(model=base, **ENGINE)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0),
                           use_tqdm=False, lora_request=LoRARequest(adapter, 1, str(lora_dir / adapter)))
        completion = out[0].outputs[0]
        return [entries[t].logprob for t, entries in zip(completion.token_ids, completion.logprobs)]

    def load(path, **extra) -> int:
        body = {"lora_name": "tuned", "lora_path": str(path), **extra}
        return client.post("/v1/load_lora_adapter", json=body).status_code

    prompt = PROMPT * 6  # 48 tokens: whole KV blocks for the prefix cache
    shutil.copytree(lora_dir / "alpha", lora_dir / "tuned")
    assert load(lora_dir / "tuned") == 200
    assert answer("tuned", prompt) == pytest.approx(offline("alpha", prompt), abs=1e-5)
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "tuned"}).status_code == 200
    shutil.copytree(lora_dir / "beta", lora_dir / "tuned", dirs_exist_ok=True)  # the new weights, in place
    assert load(lora_dir / "tuned") == 200
    assert answer("tuned", prompt) == pytest.approx(offline("beta", prompt), abs=1e-5)
    # the name again from another directory, in place of the one served (without load_inplace: a 400)
    assert load(lora_dir / "alpha") == 400
    assert load(lora_dir / "alpha", load_inplace=True) == 200
    assert answer("tuned", prompt) == pytest.approx(offline("alpha", prompt), abs=1e-5)
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "tuned"}).status_code == 200


def test_on_demand_a_request_naming_a_folder_of_the_lora_dir_loads_its_adapter_once(
        base, lora_dir, monkeypatch):  # noqa: F811
    """vLLM's filesystem resolver: `model` names a folder of --lora-dir that holds an adapter."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    check = LLMEngine.check_lora
    # a slow load, so that the requests arrive while it runs
    monkeypatch.setattr(LLMEngine, "check_lora", lambda *args: time.sleep(0.3) or check(*args))
    entry = ModelEntry("tiny", lambda: LLMEngine.from_kwargs(model=base, **ENGINE))
    app = build_app([entry], ServerSettings(model_name="tiny"), lora_dir=lora_dir, lora_on_demand=True)
    client = serve_in_process(app)
    try:
        with ThreadPoolExecutor(4) as pool:  # at once: one load, every request answered by it
            answers = list(pool.map(lambda _: _answer(client, "alpha"), range(4)))
        expected = _offline(base, LoRARequest("alpha", 1, str(lora_dir / "alpha")))
        assert all(a == pytest.approx(expected, abs=1e-5) for a in answers)
        assert 'hyperserve:lora_adapter_loads_total{model_name="tiny"} 1.0' in client.get("/metrics").text
        assert "alpha" in {card["id"] for card in client.get("/v1/models").json()["data"]}
        broken = client.post("/v1/completions", json={"model": "broken", "prompt": PROMPT, "max_tokens": 2})
        assert broken.status_code == 400 and "adapter_model.safetensors" in broken.json()["error"]["message"]
        for name in ("absent", "../alpha", ".", "x" * 256):  # no such folder, or no folder's name
            missing = client.post("/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 2})
            assert missing.status_code == 404, name
    finally:
        client.__exit__(None, None, None)
