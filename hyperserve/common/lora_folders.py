"""Where a LoRA adapter's files are found from a client's words: a path a client gave, and the
folder of `--lora-dir` that a request's `model` names when adapters load on demand (vLLM's
filesystem resolver). Light enough for the Ray ingress, which has no torch."""

from __future__ import annotations

import re
from pathlib import Path

FOLDER_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # a `model` that may name a folder: no "/", no ".."


def is_file(path: Path) -> bool:
    """Path.is_file, False for a path the system cannot even look up (a name too long, say): a
    client's path is never a server error."""
    try:
        return path.is_file()
    except OSError:
        return False


def adapter_folder(lora_dir: Path, model: object) -> Path | None:
    """The folder of lora_dir that `model` names, if it holds an adapter (adapter_config.json)."""
    if not isinstance(model, str) or not FOLDER_NAME.fullmatch(model):
        return None
    folder = lora_dir / model
    return folder if is_file(folder / "adapter_config.json") else None
