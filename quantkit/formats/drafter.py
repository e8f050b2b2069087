"""A fitted drafter folder (`quantkit draft-heads`), read by `eval --speculative eagle:DIR|medusa:DIR`.

- `config.json`: for EAGLE, the `speculators` EAGLE-1 layout (`speculators_model_type: eagle`, a one-layer
  `transformer_layer_config`, `layernorms: false`, `fusion_bias: false`, the verifier's path); for Medusa,
  `speculators_model_type: medusa` with `num_heads`, `hidden_size`. Both carry a `quantkit` block: kind, the target's
  hidden size and vocabulary, the draft vocabulary size, the target's fingerprint.
- `model.safetensors`: EAGLE `fusion_fc.weight` and `transformer.*` (LlamaDecoderLayer names, no input norm); Medusa
  `blocks.K.weight` / `blocks.K.bias`; `draft_vocabulary` (int64 token ids, sorted) where the drafter scores a
  reduced vocabulary. The target's embedding and head are not stored: the drafter uses the target's own.
- `quantkit_manifest.json`: what it was fitted on (target fingerprint, data fingerprint, steps, losses).
Only safetensors are read; no code from the folder runs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from quantkit.errors import InputError
from quantkit.formats.files import apply_umask

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
MANIFEST = "quantkit_manifest.json"
VOCAB_KEY = "draft_vocabulary"


def target_fingerprint(path: Path) -> str:
    """sha256 of the target's config and of its quantkit manifest (which holds every weight file's sha256) where
    there is one; otherwise of each safetensors file's name, size and header (names, shapes, dtypes, offsets)."""
    path = Path(path)
    h = hashlib.sha256()
    for name in ("config.json", "quantkit_manifest.json"):
        if (path / name).is_file():
            h.update(name.encode())
            h.update((path / name).read_bytes())
    if not (path / "quantkit_manifest.json").is_file():
        for f in sorted(path.glob("*.safetensors")):
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                h.update(f"{f.name}:{f.stat().st_size}".encode())
                h.update(fh.read(min(size, 1 << 26)))
    return h.hexdigest()


def eagle_config(layer_config, meta: dict, target: str, architectures: list[str]) -> dict:
    layer = layer_config.to_diff_dict()
    layer.pop("_attn_implementation", None)
    layer.update(hidden_size=layer_config.hidden_size, intermediate_size=layer_config.intermediate_size,
                 num_attention_heads=layer_config.num_attention_heads,
                 num_key_value_heads=layer_config.num_key_value_heads, head_dim=layer_config.head_dim,
                 vocab_size=layer_config.vocab_size, model_type="llama")
    return {"speculators_model_type": "eagle", "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
            "transformer_layer_architecture": "LlamaDecoderLayer", "transformer_layer_config": layer,
            "layernorms": False, "fusion_bias": False,
            "speculators_config": {"algorithm": "eagle", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                   "verifier": {"name_or_path": target, "architectures": architectures}},
            "quantkit": meta}


def medusa_config(heads: int, hidden: int, meta: dict, target: str) -> dict:
    return {"speculators_model_type": "medusa", "num_heads": heads, "hidden_size": hidden,
            "verifier": {"name_or_path": target}, "quantkit": meta}


def save(folder: Path, config: dict, tensors: dict[str, torch.Tensor], manifest: dict) -> None:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(folder / WEIGHTS),
              metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    for name in (WEIGHTS, CONFIG, MANIFEST):
        apply_umask(folder / name)


def read(folder: Path, kind: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a drafter folder of `kind`; one-line InputError for anything else."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise InputError(f"{folder} is not a drafter folder ({CONFIG} and {WEIGHTS}; make one with "
                         f"quantkit draft-heads)")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{folder / CONFIG}: not valid JSON ({exc.msg})") from None
    found = config.get("speculators_model_type") if isinstance(config, dict) else None
    if found != kind:
        raise InputError(f"{folder} holds a {found or 'non-drafter'} checkpoint, not {kind}")
    if not isinstance(config.get("quantkit"), dict):
        raise InputError(f"{folder} was not fitted by quantkit draft-heads (no quantkit block in {CONFIG})")
    return config, load_file(str(folder / WEIGHTS))
