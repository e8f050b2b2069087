"""quantkit_manifest.json: what was made from what. sha256 of every output file and of the source weights,
the recipe, the calibration fingerprint, package versions, timings, memory and per-layer errors."""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import torch

import quantkit
from quantkit.models.safetensors_index import SafetensorsIndex

MANIFEST = "quantkit_manifest.json"
# The manifest's layout version. Raise it when a field changes meaning or is removed (adding fields is
# compatible); readers refuse a newer version instead of misreading it. Manifests written before the field
# existed (version 0) have the same layout as version 1 and are read as such.
SCHEMA_VERSION = 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def package_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"quantkit": quantkit.__version__, "python": platform.python_version()}
    for pkg in ("torch", "transformers", "compressed-tensors", "safetensors", "accelerate"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def quantized_weight_stats(folder: Path) -> dict:
    """Bits per weight of the quantised linears and of the whole model, from the written tensors."""
    index = SafetensorsIndex(folder)
    q_bits = q_weights = 0
    total_bits = total_params = 0
    modules = {n[: -len(".weight_packed")] for n in index.names() if n.endswith(".weight_packed")}
    modules |= {n[: -len(".weight_scale")] for n in index.names() if n.endswith(".weight_scale")}
    for name, info in index.tensors.items():
        total_bits += info.nbytes * 8
    for m in modules:
        if f"{m}.weight_shape" in index:
            out_f, in_f = (int(x) for x in index.get(f"{m}.weight_shape").tolist())
        elif f"{m}.weight" in index:
            out_f, in_f = index.tensors[f"{m}.weight"].shape[:2]
        else:  # fp4: two e2m1 values a byte
            out_f, in_f = index.tensors[f"{m}.weight_packed"].shape[0], index.tensors[f"{m}.weight_packed"].shape[1] * 2
        q_weights += out_f * in_f
        for suffix in ("weight_packed", "weight", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape",
                       "weight_global_scale"):
            if f"{m}.{suffix}" in index:
                q_bits += index.tensors[f"{m}.{suffix}"].nbytes * 8
    for name, info in index.tensors.items():
        if name.endswith((".weight_packed",)):
            continue
        if name.endswith((".weight_scale", ".weight_zero_point", ".weight_g_idx", ".weight_shape", "input_scale",
                          ".weight_global_scale", ".input_global_scale")):
            continue
        n = 1
        for d in info.shape:
            n *= d
        total_params += n
    total_params += q_weights
    return {
        "bits_per_weight": round(q_bits / q_weights, 4) if q_weights else None,
        "model_bits_per_param": round(total_bits / total_params, 4) if total_params else None,
        "quantized_weights": q_weights,
        "total_params": total_params,
    }


def write_manifest(folder: Path, recipe, summary: dict, handle) -> dict:
    folder = Path(folder)
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MANIFEST and not path.name.startswith("."):
            files[path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    source_files = {}
    for path in sorted({info.file for info in handle.index.tensors.values()}):
        source_files[path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    stats = quantized_weight_stats(folder)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "quantkit_version": quantkit.__version__,
        "source": {"model": summary["model"], "path": summary["model_path"], "files": source_files,
                   "bytes": summary["original_bytes"]},
        "recipe": recipe.to_dict(),
        "calibration": summary["calibration"],
        "versions": package_versions(),
        "device": summary["device"],
        # The GPU's name and the peak bytes torch allocated on it (null on CPU, where peak_rss_bytes covers it),
        # and where the calibration activations lived (device, host or disk).
        "device_name": summary.get("device_name"),
        "device_peak_bytes": summary.get("device_peak_bytes"),
        "activations": summary.get("activations"),
        "torch_threads": torch.get_num_threads(),
        "compute": summary.get("compute"),  # the matmul dtype and the speeds it was chosen from
        "wall_seconds": summary["wall_seconds"],
        "phase_seconds": summary.get("phase_seconds"),  # the layers' `phases` summed, plus outside_layers
        "peak_rss_bytes": summary["peak_rss_bytes"],
        "scheme": summary["scheme"],
        "method": summary["method"],
        **file_sizes(files),
        **stats,
        "layers": summary["layers"],
        "events": summary["events"],
        "scheme_overrides": summary.get("scheme_overrides", {}),  # linears on a fallback scheme, by name
        "tp_warnings": summary.get("tp_warnings", []),
        **({"experts": summary["experts"]} if "experts" in summary else {}),  # MoE: calibration, starved experts
        "files": files,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def read_manifest(folder: Path) -> dict:
    """The manifest of a checkpoint folder, its schema version checked (InputError when unreadable or newer
    than this quantkit understands)."""
    from quantkit.errors import InputError

    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(manifest, dict):
        raise InputError(f"{path} is not a quantkit manifest (not a JSON object)")
    version = manifest.get("schema_version", 0)
    if not isinstance(version, int) or version < 0:
        raise InputError(f"{path} has an invalid schema_version {version!r}")
    if version > SCHEMA_VERSION:
        raise InputError(f"{path} has manifest schema_version {version}, newer than this quantkit "
                         f"{quantkit.__version__} reads ({SCHEMA_VERSION}); upgrade quantkit")
    return manifest


def verify_manifest(folder: Path) -> list[str]:
    """Names of files whose hash or size does not match the manifest (missing files included)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    bad = []
    for name, meta in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != meta["bytes"] or sha256_file(path) != meta["sha256"]:
            bad.append(name)
    return bad


def file_sizes(files: dict[str, dict]) -> dict[str, int]:
    """The two sizes a checkpoint has, named apart: `weights_bytes` (its *.safetensors files, what a runtime
    loads) and `output_bytes` (every file of the folder the manifest lists: weights, config, tokenizer, recipe;
    all but the manifest itself, a few kB, so that `plan` can predict it exactly)."""
    return {"weights_bytes": sum(f["bytes"] for n, f in files.items() if n.endswith(".safetensors")),
            "output_bytes": sum(f["bytes"] for f in files.values())}
