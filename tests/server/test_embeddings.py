"""/v1/embeddings on the shared server (`--embedding-model all-MiniLM-L6-v2`), against the model run
directly through transformers with sentence-transformers' pooling (mean over tokens, unit length)."""

from __future__ import annotations

import functools

import httpx
import numpy as np
import openai
import pytest
import torch

TEXTS = ["The cat sat on the mat.", "A feline rested on the rug.", "Stock prices fell sharply on Monday."]
MODEL = "all-MiniLM-L6-v2"


@functools.cache
def reference_model():
    from transformers import AutoModel, AutoTokenizer

    from hyperserve.common.embedder import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path()), AutoModel.from_pretrained(default_model_path()).eval()


def reference(texts: list[str], max_length: int | None = None) -> np.ndarray:
    tokenizer, model = reference_model()
    batch = tokenizer(texts, padding=True, truncation=max_length is not None, max_length=max_length,
                      return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return (mean / mean.norm(dim=-1, keepdim=True)).numpy()


def post(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)


def test_embeddings_match_the_model_run_directly(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    answer = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    vectors = np.array([item.embedding for item in answer.data])
    assert [item.index for item in answer.data] == [0, 1, 2]
    np.testing.assert_allclose(vectors, reference(TEXTS), atol=2e-5)
    tokenizer, _ = reference_model()
    assert answer.usage.prompt_tokens == sum(len(ids) for ids in tokenizer(TEXTS)["input_ids"])
    as_floats = post(server, input=TEXTS[1], encoding_format="float").json()  # no model named: the encoder
    np.testing.assert_allclose(as_floats["data"][0]["embedding"], vectors[1], atol=1e-6)
    assert as_floats["model"] == MODEL


def test_inputs_over_the_window_are_refused_unless_truncated(server):
    long_text = "word " * 400  # ~400 tokens, over the model's 256
    refused = post(server, input=["short", long_text])
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert "input 1" in refused.json()["error"]["message"]
    truncated = post(server, input=long_text, truncate=True, encoding_format="float").json()
    np.testing.assert_allclose(truncated["data"][0]["embedding"], reference([long_text], 256)[0], atol=2e-5)
    assert truncated["usage"]["prompt_tokens"] == 256


@pytest.mark.parametrize("body, status, param", [
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": [1, 2]}, 400, "input"),
    ({"input": "hi", "dimensions": 64}, 400, "dimensions"),
    ({"input": "hi", "model": "smollm2-135m"}, 400, "model"),
    ({"input": "hi", "model": "nope"}, 404, "model"),
    ({"input": ["x"] * 2049}, 400, "input"),
])
def test_bad_embedding_requests_get_openai_errors(server, body, status, param):
    reply = post(server, **body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_score_and_rerank_are_the_cosine_of_the_embeddings(server):
    """vLLM's /v1/score and the Jina/Cohere /v1/rerank with an embedding model: each score is the
    cosine similarity of the two texts' embeddings (here, the model run directly)."""
    query, documents = "Where does the cat sleep?", TEXTS
    expected = reference(documents) @ reference([query])[0]
    reply = httpx.post(f"{server.url}/v1/rerank", json={"query": query, "documents": documents, "top_n": 2}).json()
    assert [r["index"] for r in reply["results"]] == list(np.argsort(-expected)[:2])
    np.testing.assert_allclose([r["relevance_score"] for r in reply["results"]], np.sort(expected)[::-1][:2],
                               atol=2e-5)
    assert reply["results"][0]["document"] == {"text": documents[reply["results"][0]["index"]]}
    assert reply["model"] == MODEL and reply["usage"]["total_tokens"] > 0
    cohere = httpx.post(f"{server.url}/v2/rerank", json={"query": query, "return_documents": False,
                                                         "documents": [{"text": d} for d in documents]}).json()
    assert [r["index"] for r in cohere["results"]] == list(np.argsort(-expected)) and "document" not in cohere[
        "results"][0]

    one_to_many = httpx.post(f"{server.url}/v1/score", json={"text_1": query, "text_2": documents}).json()
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]], expected, atol=2e-5)
    pairs = httpx.post(f"{server.url}/score", json={"text_1": documents[:2], "text_2": documents[1:]}).json()
    reference_pairs = (reference(documents[:2]) * reference(documents[1:])).sum(1)
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], reference_pairs, atol=2e-5)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/rerank", {"query": "a", "documents": ["b", ""]}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "model": "smollm2-135m"}, "model"),
])
def test_bad_score_and_rerank_requests_get_400s(server, path, body, param):
    reply = httpx.post(f"{server.url}{path}", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
