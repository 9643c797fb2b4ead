"""RequestLog: one JSON object per line and request, for the gateway's request log and the
security layer's audit log."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


class RequestLog:
    """One JSON object per line and request: route, backend, cache outcome, latency breakdown
    (milliseconds) and tokens. Never prompts or keys."""

    def __init__(self, path: str | None) -> None:
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1) if path else None  # lives as long as the app
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        line = json.dumps({"ts": round(time.time(), 3), **record}, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
