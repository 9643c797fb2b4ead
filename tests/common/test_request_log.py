import json

from hyperserve.common.request_log import RequestLog


def test_request_log_creates_its_directory_and_writes_json_lines(tmp_path):
    path = tmp_path / "not" / "yet" / "requests.jsonl"
    log = RequestLog(str(path))
    log.write({"route": "m", "status": 200})
    log.write({"route": "m", "status": 502})
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["status"] for r in records] == [200, 502] and all("ts" in r for r in records)
