"""`quantkit inspect`: what a checkpoint is, how big, per-layer figures, and whether its files are intact."""

from __future__ import annotations

import json
import re
from pathlib import Path

from quantkit.errors import InputError
from quantkit.formats.manifest import MANIFEST, quantized_weight_stats, read_manifest, verify_manifest


def _scheme_name(qc: dict) -> str:
    groups = qc.get("config_groups") or {}
    names = []
    for group in groups.values():
        w = group.get("weights") or {}
        a = group.get("input_activations")
        bits = w.get("num_bits")
        kind = "FP" if w.get("type") == "float" else "W"
        act = f"A{'FP' if a.get('type') == 'float' else ''}{a.get('num_bits')}" if a else "A16"
        if kind == "FP" and bits == 4:  # the fp4 layouts have names of their own
            names.append(("NVFP4" if w.get("strategy") == "tensor_group" else "MXFP4") + ("" if a else "A16"))
            continue
        name = f"{kind}{bits}{act}" if kind == "W" else f"FP{bits}"
        if w.get("strategy") == "group":
            name += f" g{w.get('group_size')}"
        elif w.get("strategy"):
            name += f" {w.get('strategy')}"
        if w.get("symmetric") is False:
            name += " asym"
        names.append(name)
    kv = qc.get("kv_cache_scheme")
    if kv:
        names.append(f"fp8 KV cache ({kv.get('strategy')})")
    return ", ".join(names) or "?"


def inspect_checkpoint(folder: Path) -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"checkpoint {folder} does not exist or is not a folder")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise InputError(f"{folder} is not a model folder: config.json is missing")
    config = json.loads(config_path.read_text())
    qc = config.get("quantization_config") or {}
    manifest_path = folder / MANIFEST
    manifest = read_manifest(folder) if manifest_path.is_file() else None
    mismatches = verify_manifest(folder) if manifest else [f"{MANIFEST} (missing)"]
    stats = quantized_weight_stats(folder)
    from quantkit.formats.manifest import file_sizes

    sizes = file_sizes({p.name: {"bytes": p.stat().st_size} for p in folder.iterdir() if p.is_file() and p.name != MANIFEST})
    size = sizes["weights_bytes"]
    original = (manifest or {}).get("source", {}).get("bytes") or size
    per_layer: dict[int, dict] = {}
    from quantkit.models.safetensors_index import SafetensorsIndex

    for name in SafetensorsIndex(folder).names():
        m = re.search(r"layers\.(\d+)\.", name)
        if m and (name.endswith(".weight_packed") or name.endswith(".weight_scale")):
            row = per_layer.setdefault(int(m.group(1)), {"linears": set()})
            row["linears"].add(name.rpartition(".")[0])
    records = {r["layer"]: r for r in (manifest or {}).get("layers", [])}
    layers = [
        {"layer": i, "linears": len(per_layer[i]["linears"]),
         "rel_error": records.get(i, {}).get("rel_error"), "seconds": records.get(i, {}).get("seconds")}
        for i in sorted(per_layer)
    ]
    return {
        "path": str(folder),
        "model_type": config.get("model_type"),
        "format": qc.get("format"),
        "scheme": _scheme_name(qc) if qc else "unquantised",
        "method": (manifest or {}).get("method"),
        "ignore": qc.get("ignore"),
        "bits_per_weight": stats["bits_per_weight"],
        "model_bits_per_param": stats["model_bits_per_param"],
        "size_bytes": size,  # the weights (*.safetensors)
        "folder_bytes": sizes["output_bytes"],
        "original_bytes": original,
        "size_ratio": size / original if original else 1.0,
        "layers": layers,
        "events": (manifest or {}).get("events", []),
        "hash_mismatches": mismatches,
    }
