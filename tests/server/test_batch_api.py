"""The Batch API on the real server: a batch's answers are what the same requests get one by one, with
more lines than the server's queue admits (their 429s are retried)."""

from __future__ import annotations

import json
import time

import httpx
import openai


def test_a_batch_gets_the_answers_of_its_requests_sent_alone(server):
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    questions = ["Name a colour.", "What is 2 + 2?", "Say hello.", "Name a fruit.", "Name a river.", "Count to 3.",
                 "Name a planet.", "Say yes."]  # twice the server's --max-queue of 4
    bodies = [{"messages": [{"role": "user", "content": q}], "max_tokens": 8, "temperature": 0} for q in questions]
    bodies.append({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0})  # a 400
    data = "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
                   + "\n" for i, body in enumerate(bodies))
    upload = api.files.create(file=("questions.jsonl", data.encode()), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.time() + 120
    while (batch := api.batches.retrieve(batch.id)).status != "completed":
        assert batch.status in ("validating", "in_progress", "finalizing") and time.time() < deadline, batch
        time.sleep(0.1)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(questions), 1)
    output = [json.loads(line) for line in api.files.content(batch.output_file_id).text.splitlines()]
    alone = [httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
             ["content"] for body in bodies[:-1]]
    assert [line["response"]["body"]["choices"][0]["message"]["content"] for line in output] == alone
    [error] = [json.loads(line) for line in api.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == f"q{len(questions)}" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "max_tokens"
    server.wait_idle()
