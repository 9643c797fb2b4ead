"""The browser pages (hyperserve/server/ui: a chat playground and a live dashboard), served by the
same process as the API: static files at /ui/ (no CDN, nothing loaded from elsewhere), / sends a
browser there, and GET /stats gives the dashboard the process's metrics as JSON."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry

UI_DIRECTORY = Path(__file__).resolve().parents[1] / "server" / "ui"


def metrics_snapshot(registry: CollectorRegistry) -> dict[str, Any]:
    """Every sample of `registry` by sample name ({labels, value} each), and the time it was taken:
    the Prometheus text as JSON, which the dashboard turns into rates and percentiles."""
    samples: dict[str, list[dict[str, Any]]] = {}
    for family in registry.collect():
        for sample in family.samples:
            samples.setdefault(sample.name, []).append({"labels": sample.labels, "value": sample.value})
    return {"time": time.time(), "samples": samples}


def install_web_ui(app: FastAPI, registry: CollectorRegistry, kind: str,
                   refresh: Callable[[], None] | None = None,
                   more_samples: Callable[[], Awaitable[dict[str, list]]] | None = None) -> None:
    """/ui/ (`kind`: "server" or "gateway", which the pages read from /ui/kind.json), / and /stats;
    `refresh` updates gauges that are set when read (the gateway's backend health); `more_samples`
    adds others' (the engine behind `hyperserve serve --response-cache`)."""

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    @app.get("/ui/kind.json", include_in_schema=False)
    async def ui_kind() -> dict[str, str]:
        return {"kind": kind}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """The metrics of /metrics as JSON (the dashboard polls it every second)."""
        if refresh is not None:
            refresh()
        snapshot = metrics_snapshot(registry)
        if more_samples is not None:
            for name, samples in (await more_samples()).items():
                snapshot["samples"].setdefault(name, []).extend(samples)
        return snapshot

    app.mount("/ui", StaticFiles(directory=UI_DIRECTORY, html=True), name="ui")
