"""`quantkit release RECIPE.yaml`: a release recipe -> quantised variants -> one evaluation against the base ->
gates -> a model card in each checkpoint and a release summary (release.md, release.json).

A variant already built with the same inputs is not rebuilt. Its manifest tells: the recipe it was made with (the
output path aside), the quantkit version, the sha256 of every source weight file, and the sha256 of every file it
wrote (still intact). All variants are evaluated in one `run_eval`, so the baseline's logits are computed once.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import quantkit
from quantkit.errors import InputError
from quantkit.recipe import CalibrationSpec, ModelSpec, Recipe, load_yaml_mapping

GATE_KEYS = ("max_kl", "max_ppl_increase", "min_top1")


@dataclass
class Gates:
    max_kl: float | None = None
    max_ppl_increase: float | None = None  # percent
    min_top1: float | None = None
    serving: bool = False  # the variant must pass check-serving for the release's serving target


@dataclass
class VariantSpec:
    name: str
    method: str
    scheme: str
    group_size: int = 128
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    options: dict = field(default_factory=dict)
    strict: bool = False
    calibration: dict = field(default_factory=dict)  # overrides of the release's calibration fields
    gates: dict = field(default_factory=dict)  # overrides of the release's gates


@dataclass
class EvaluationSpec:
    dataset: str = "kjv"
    num_samples: int = 32
    seq_len: int = 512
    seed: int = 42
    tasks: list[str] = field(default_factory=list)
    throughput: bool = False
    batch_size: int = 4
    engine: str = "quantkit"  # quantkit | vllm (as `quantkit eval --engine`)


@dataclass
class ServingSpec:
    tp: int = 1
    pp: int = 1
    gpu: str = "sm_90"
    vllm_version: str | None = None


@dataclass
class ReleaseRecipe:
    name: str
    base: ModelSpec
    calibration: CalibrationSpec
    variants: list[VariantSpec]
    evaluation: EvaluationSpec
    gates: Gates
    serving: ServingSpec
    output: str | None = None
    determinism_variants: list[str] | None = None  # which variants --verify-determinism builds twice (default: all)

    @classmethod
    def load(cls, path: str | Path) -> "ReleaseRecipe":
        data = load_yaml_mapping(path, "release recipe")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise InputError(f"release recipe has unknown section(s): {', '.join(sorted(unknown))}")
        if not data.get("name"):
            raise InputError("release recipe needs a `name`")
        raw_variants = data.get("variants") or []
        if not raw_variants:
            raise InputError("release recipe needs at least one entry under `variants`")
        variants = [_build(VariantSpec, v, f"variant {i}") for i, v in enumerate(raw_variants)]
        names = [v.name for v in variants]
        if len(set(names)) != len(names):
            raise InputError(f"release recipe has duplicate variant names: {', '.join(names)}")
        for v in variants:
            bad = set(v.gates) - set(GATE_KEYS) - {"serving"}
            if bad:
                raise InputError(f"variant {v.name}: unknown gate(s) {', '.join(sorted(bad))}")
        rec = cls(
            name=str(data["name"]), base=_build(ModelSpec, data.get("base"), "base"),
            calibration=_build(CalibrationSpec, data.get("calibration"), "calibration"), variants=variants,
            evaluation=_build(EvaluationSpec, data.get("evaluation"), "evaluation"),
            gates=_build(Gates, data.get("gates"), "gates"), serving=_build(ServingSpec, data.get("serving"), "serving"),
            output=data.get("output"), determinism_variants=_name_list(data.get("determinism_variants")),
        )
        if rec.evaluation.engine not in ("quantkit", "vllm"):  # before hours of quantising
            raise InputError(f"evaluation.engine {rec.evaluation.engine!r}: use quantkit or vllm")
        stray = [n for n in rec.determinism_variants or [] if n not in names]
        if stray:
            raise InputError(f"determinism_variants: {', '.join(stray)} not a variant ({', '.join(names)})")
        return rec

    def variant_recipe(self, v: VariantSpec, output: Path) -> Recipe:
        r = Recipe(model=ModelSpec(**asdict(self.base)))
        r.quantization.method, r.quantization.scheme, r.quantization.group_size = v.method, v.scheme, v.group_size
        r.quantization.ignore, r.quantization.options, r.quantization.strict = list(v.ignore), dict(v.options), v.strict
        calib = {**asdict(self.calibration), **v.calibration}
        bad = set(calib) - {f.name for f in fields(CalibrationSpec)}
        if bad:
            raise InputError(f"variant {v.name}: unknown calibration field(s) {', '.join(sorted(bad))}")
        r.calibration = CalibrationSpec(**calib)
        r.output = str(output)
        return r

    def gates_for(self, v: VariantSpec) -> Gates:
        return Gates(**{**asdict(self.gates), **v.gates})


def _name_list(value) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InputError("determinism_variants must be a variant name or a list of them")
    return value


def _build(cls, data, where: str):
    data = data or {}
    if not isinstance(data, dict):
        raise InputError(f"release recipe section {where!r} must be a mapping")
    names = {f.name for f in fields(cls)}
    bad = set(data) - names
    if bad:
        raise InputError(f"release recipe section {where!r} has unknown field(s): {', '.join(sorted(bad))}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise InputError(f"release recipe section {where!r}: {exc}") from None


@dataclass
class ReleaseOptions:
    recipe_path: Path
    output: Path | None = None
    verify_determinism: bool = False
    device: str = "auto"
    compute_dtype: str = "auto"
    force: bool = False  # rebuild variants even when their manifest matches


# ------------------------------------------------------------------------------------------------ building


def _recipe_key(recipe_dict: dict) -> str:
    d = json.loads(json.dumps(recipe_dict, default=str))
    d["output"] = None
    return json.dumps(d, sort_keys=True)


def already_built(output: Path, recipe: Recipe) -> str | None:
    """None when `output` holds this recipe's build from the same source weights by this quantkit version, else why
    it must be (re)built."""
    from quantkit.formats.manifest import MANIFEST, read_manifest, sha256_file, verify_manifest
    from quantkit.models.source import resolve_model

    if not (output / MANIFEST).is_file():
        return "not built yet"
    manifest = read_manifest(output)
    if manifest.get("quantkit_version") != quantkit.__version__:
        return f"built by quantkit {manifest.get('quantkit_version')}"
    if _recipe_key(manifest.get("recipe", {})) != _recipe_key(recipe.to_dict()):
        return "recipe changed"
    source = resolve_model(recipe.model.source).path
    recorded = manifest.get("source", {}).get("files", {})
    current = {p.name for p in source.glob("*.safetensors")}
    if set(recorded) != current or any(sha256_file(source / n) != meta["sha256"] for n, meta in recorded.items()):
        return "source weights changed"
    if verify_manifest(output):
        return "files changed since the build"
    return None


def _build_variant(recipe: Recipe, output: Path, opts: ReleaseOptions) -> dict:
    from quantkit.pipeline.engine import quantize_model

    return quantize_model(recipe, output, overwrite=True, device=opts.device, compute_dtype=opts.compute_dtype)


def _tensor_hashes(folder: Path) -> dict[str, str]:
    from quantkit.formats.manifest import sha256_file

    return {p.name: sha256_file(p) for p in sorted(folder.glob("*.safetensors"))}


# ------------------------------------------------------------------------------------------------ gates


def evaluate_variant_gates(row: dict, gates: Gates, serving: dict | None) -> list[dict]:
    checks = (("max_kl", "kl_mean", gates.max_kl, lambda v, t: v <= t),
              ("max_ppl_increase", "ppl_increase_pct", gates.max_ppl_increase, lambda v, t: v <= t),
              ("min_top1", "top1_agree", gates.min_top1, lambda v, t: v >= t))
    out = []
    for gate, metric, threshold, ok in checks:
        if threshold is None:
            continue
        value = row[metric]
        out.append({"gate": gate, "metric": metric, "threshold": threshold, "value": value,
                    "passed": bool(ok(value, threshold))})
    if gates.serving and serving is not None:
        out.append({"gate": "serving", "metric": "check-serving", "threshold": _serving_label(serving["target"]),
                    "value": "loads" if serving["compatible"] else f"{len(serving['problems'])} problem(s)",
                    "passed": bool(serving["compatible"])})
    return out


def _serving_label(t: dict) -> str:
    where = "cpu" if t["platform"] == "cpu" else f"sm_{t['compute_capability']}"
    return f"vLLM {t['vllm_version']} {where} tp={t['tp']} pp={t['pp']}"


# ------------------------------------------------------------------------------------------------ run


def run_release(opts: ReleaseOptions) -> dict:
    from quantkit.eval.report import write_plots, write_report
    from quantkit.eval.runner import EvalOptions, run_eval
    from quantkit.optional import require
    from quantkit.progress import announce
    from quantkit.serving.check import ServingTarget, check_serving

    rec = ReleaseRecipe.load(opts.recipe_path)
    require("matplotlib", "release (model-card KL plots)")  # before hours of quantising
    root = Path(opts.output or rec.output or f"release-{rec.name}")
    root.mkdir(parents=True, exist_ok=True)
    variants = []
    for v in rec.variants:
        out = root / v.name
        recipe = rec.variant_recipe(v, out)
        why = "forced" if opts.force else already_built(out, recipe)
        if why is None:
            announce(f"{v.name}: already built with the same recipe, source and quantkit version; kept")
            built = False
        else:
            announce(f"{v.name}: building ({why})")
            _build_variant(recipe, out, opts)
            built = True
        variants.append({"spec": v, "recipe": recipe, "output": out, "built": built})

    determinism = verify_determinism(rec, variants, root, opts) if opts.verify_determinism else None

    ev = rec.evaluation
    eval_opts = EvalOptions(checkpoints=[x["output"] for x in variants], baseline=rec.base.source,
                            dataset=ev.dataset, num_samples=ev.num_samples, seq_len=ev.seq_len, seed=ev.seed,
                            tasks=list(ev.tasks), throughput=ev.throughput, device=opts.device,
                            batch_size=ev.batch_size, engine=ev.engine)
    run = run_eval(eval_opts)
    write_report(root / "eval", run.report, run.token_kl)
    results = {r["checkpoint"]: r for r in run.report["results"]}

    summary_variants = []
    for x in variants:
        v, out = x["spec"], x["output"]
        row = results[str(out)]
        serving = check_serving(out, ServingTarget(rec.serving.tp, rec.serving.pp, rec.serving.gpu,
                                                   rec.serving.vllm_version))
        gates = evaluate_variant_gates(row, rec.gates_for(v), serving)
        write_plots_for_variant(out, row, run.token_kl[str(out)], write_plots)
        entry = {
            "name": v.name, "output": str(out), "scheme": v.scheme, "method": v.method,
            "kl_mean": row["kl_mean"], "ppl": row["ppl"], "size_bytes": row["size_bytes"],
            "gates": gates, "passed": all(g["passed"] for g in gates),
            "built": x["built"], "bits_per_weight": row["bits_per_weight"], "ppl_base": row["ppl_base"],
            "ppl_increase_pct": row["ppl_increase_pct"], "kl_p99": row["kl_p99"], "top1_agree": row["top1_agree"],
            "tasks": row.get("tasks", {}), "throughput": row.get("throughput"), "engine": engine_label(run.report, row),
            "kernels": kernel_names(row),
            "serving": {"compatible": serving["compatible"], "target": serving["target"],
                        "kernel_families": serving["kernel_families"], "problems": serving["problems"][:20]},
        }
        summary_variants.append(entry)

    summary = {
        "name": rec.name,
        "base": {"model": run.report["baseline"]["model"], "ppl": run.report["baseline"]["ppl"],
                 "size_bytes": run.report["baseline"]["size_bytes"], "tasks": run.report["baseline"].get("tasks", {}),
                 "throughput": run.report["baseline"].get("throughput")},
        "variants": summary_variants,
        "passed": all(v["passed"] for v in summary_variants) and (determinism is None or all(
            d["identical"] for d in determinism)),
        "determinism": determinism,
        "evaluation": {"report": "eval/report.json", "data": run.report["data"]},
        "quantkit_version": quantkit.__version__,
        "recipe": str(opts.recipe_path),
    }
    for entry, x in zip(summary_variants, variants):
        (x["output"] / "README.md").write_text(render_card(entry, summary, x["recipe"], x["output"]))
    (root / "release.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (root / "release.md").write_text(render_release_md(summary) + "\n")
    summary["output"] = str(root)
    return summary


def verify_determinism(rec: ReleaseRecipe, variants: list[dict], root: Path, opts: ReleaseOptions) -> list[dict]:
    """Build each chosen variant a second time into a scratch folder and compare every tensor file's sha256."""
    from quantkit.progress import announce

    out = []
    for name in rec.determinism_variants or [v.name for v in rec.variants]:
        entry = next(x for x in variants if x["spec"].name == name)
        twin = root / ".determinism" / name
        announce(f"{name}: building a second time (--verify-determinism)")
        _build_variant(rec.variant_recipe(entry["spec"], twin), twin, opts)
        first, second = _tensor_hashes(entry["output"]), _tensor_hashes(twin)
        out.append({"variant": name, "identical": first == second, "files": first,
                    "mismatched": sorted(n for n in set(first) | set(second) if first.get(n) != second.get(n))})
        shutil.rmtree(root / ".determinism", ignore_errors=True)
    return out


def engine_label(report: dict, row: dict) -> str:
    """Which engine measured a row, on what: named in every card next to its throughput."""
    if row.get("engine") == "vllm":
        v = row.get("vllm", {})
        return f"vLLM {v.get('vllm_version', '?')} (tensor-parallel {row.get('tensor_parallel_size', 1)})"
    t = row.get("throughput") or {}
    cfg = t.get("config", {})
    where = cfg.get("device") or report.get("device", "?")
    if cfg.get("cpu_capability"):
        where += f" {cfg['cpu_capability']}"
    threads = f", {cfg['threads']} threads" if cfg.get("threads") else ""
    return f"quantkit {quantkit.__version__} runtime on {where}{threads}"


def kernel_names(row: dict) -> str | None:
    """The kernels that served a row's quantised linears in quantkit's runtime (None for other engines)."""
    names = sorted({name for served in (row.get("kernels") or {}).values() for name in served})
    return ", ".join(names) or None


def write_plots_for_variant(out: Path, row: dict, token_kl, write_plots) -> None:
    """kl_distribution.png (this variant's per-token KL) next to its card. Files outside the manifest: the
    checkpoint's hashes are unchanged."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_plots(Path(tmp), {"results": [row], "baseline": {}}, {row["checkpoint"]: token_kl})
        shutil.copyfile(Path(tmp) / "kl_distribution.png", out / "kl_distribution.png")


# ------------------------------------------------------------------------------------------------ documents


def _fmt(v) -> str:
    return "-" if v is None else str(v)


def render_card(entry: dict, summary: dict, recipe: Recipe, out: Path) -> str:
    from quantkit.formats.manifest import read_manifest

    manifest = read_manifest(out)
    base = summary["base"]
    size_ratio = entry["size_bytes"] / base["size_bytes"] if base["size_bytes"] else None
    lines = [
        f"# {summary['name']} / {entry['name']}", "",
        f"{entry['scheme']} quantisation of `{base['model']}` by quantkit {summary['quantkit_version']} "
        f"(method `{entry['method']}`), a compressed-tensors checkpoint for vLLM and transformers.", "",
        f"- size: {entry['size_bytes']} bytes ({_fmt(round(size_ratio, 4) if size_ratio else None)}x the base's "
        f"{base['size_bytes']}), {entry['bits_per_weight']} bits per weight (quantised linears)",
        f"- release gates: {'passed' if entry['passed'] else 'FAILED'}", "",
        "## Accuracy (against the base model)", "",
        "| metric | value |", "|---|---|",
        f"| perplexity | {entry['ppl']} |", f"| base perplexity | {entry['ppl_base']} |",
        f"| perplexity increase % | {entry['ppl_increase_pct']} |",
        f"| KL mean | {entry['kl_mean']} |", f"| KL p99 | {entry['kl_p99']} |",
        f"| top-1 agreement | {entry['top1_agree']} |",
    ]
    for task, m in (entry.get("tasks") or {}).items():
        lines.append(f"| task {task} acc (base {base['tasks'].get(task, {}).get('acc', '-')}) | {m.get('acc')} |")
    data = summary["evaluation"]["data"]
    lines += ["", f"Data: `{data['source']}` ({data['split']} split), {data['num_samples']} x {data['seq_len']} "
                  f"tokens, fingerprint `{data['fingerprint'][:16]}`.", "",
              "![per-token KL distribution](kl_distribution.png)", ""]
    lines += throughput_section(entry, base)
    lines += ["## Gates", "",
              "| gate | metric | threshold | value | passed |", "|---|---|---|---|---|"]
    for g in entry["gates"]:
        lines.append(f"| {g['gate']} | {g['metric']} | {g['threshold']} | {g['value']} | {g['passed']} |")
    s = entry["serving"]
    lines += ["", "## Serving with vLLM", "", "```bash", f"vllm serve {out.name}", "```", "",
              f"`quantkit check-serving` ({_serving_label(s['target'])}): "
              f"{'loads' if s['compatible'] else 'does NOT load'}; kernels: "
              + (", ".join(f"{k} ({n} linears)" for k, n in s["kernel_families"].items()) or "-")]
    for p in s["problems"][:5]:
        lines.append(f"- {p['tensor']}: {p['reason']}")
    lines += ["", "## Recipe", "", "```yaml", recipe.to_yaml().rstrip(), "```", "", "## Provenance", "",
              f"- quantkit {manifest.get('quantkit_version')}, manifest schema {manifest.get('schema_version', 0)}",
              f"- calibration fingerprint `{(manifest.get('calibration') or {}).get('fingerprint', 'data-free')}`", ""]
    lines += ["| file | sha256 |", "|---|---|"]
    for name, meta in manifest.get("source", {}).get("files", {}).items():
        lines.append(f"| source {name} | `{meta['sha256']}` |")
    for name, meta in manifest.get("files", {}).items():
        if name.endswith(".safetensors"):
            lines.append(f"| {name} | `{meta['sha256']}` |")
    return "\n".join(lines) + "\n"


THROUGHPUT_LABELS = {"prefill_tok_s": "prefill tokens/s", "ttft_ms": "time to first token ms",
                     "peak_memory_bytes": "peak memory bytes", "resident_weight_bytes": "resident weight bytes"}


def _throughput_label(key: str) -> str | None:
    if key in THROUGHPUT_LABELS:
        return THROUGHPUT_LABELS[key]
    for stem, what in (("decode_tok_s_b", "decode tokens/s, batch "), ("generate_tok_s_b", "generation tokens/s, batch ")):
        if key.startswith(stem):
            return what + key[len(stem):]
    return None


def throughput_section(entry: dict, base: dict) -> list[str]:
    """The card's throughput table: this variant against the base, both measured in the same evaluation run."""
    t, b = entry.get("throughput"), base.get("throughput") or {}
    if not t:
        return []
    cfg = t.get("config", {})
    machine = f"; load average {cfg['load_average']}" if cfg.get("load_average") is not None else ""
    kernels = f" (kernels: {entry['kernels']})" if entry.get("kernels") else ""
    lines = ["## Throughput", "", f"Measured by {entry['engine']}{kernels}{machine}, base and variant in the same "
             "run.", "",
             "| metric | this checkpoint | base | ratio |", "|---|---|---|---|"]
    for key, value in t.items():
        label = _throughput_label(key)
        if label is None or not isinstance(value, (int, float)):
            continue
        ref = b.get(key)
        ratio = f"{value / ref:.2f}x" if isinstance(ref, (int, float)) and ref else "-"
        lines.append(f"| {label} | {value:.4g} | {_fmt(ref if ref is None else f'{ref:.4g}')} | {ratio} |")
    return lines + [""]


def _decode_b1(v: dict) -> str:
    t = v.get("throughput") or {}
    value = t.get("decode_tok_s_b1", t.get("generate_tok_s_b1"))
    return "-" if value is None else f"{value:.1f}"


def render_release_md(summary: dict) -> str:
    lines = [f"# Release {summary['name']}", "",
             f"Base `{summary['base']['model']}` (perplexity {summary['base']['ppl']}, {summary['base']['size_bytes']} "
             f"bytes); overall: {'passed' if summary['passed'] else 'FAILED'}.", "",
             "| variant | scheme | method | KL mean | ppl | size bytes | decode tok/s b1 | gates | passed |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = summary["base"]
    if base.get("throughput"):
        lines.append(f"| base | - | - | 0 | {base['ppl']} | {base['size_bytes']} | {_decode_b1(base)} | - | - |")
    for v in summary["variants"]:
        gates = ", ".join(f"{g['gate']} {'ok' if g['passed'] else 'FAIL'}" for g in v["gates"]) or "-"
        lines.append(f"| [{v['name']}]({Path(v['output']).name}/README.md) | {v['scheme']} | {v['method']} | "
                     f"{v['kl_mean']} | {v['ppl']} | {v['size_bytes']} | {_decode_b1(v)} | {gates} | {v['passed']} |")
    if any(v.get("throughput") for v in summary["variants"]):
        lines += ["", f"Throughput measured by {summary['variants'][0]['engine']} (details in each card)."]
    checks = [f"`{d['variant']}` {'identical' if d['identical'] else 'DIFFER: ' + ', '.join(d['mismatched'])}"
              for d in summary.get("determinism") or []]
    if checks:
        lines += ["", f"Determinism (each built twice, every tensor file's sha256 compared): {'; '.join(checks)}."]
    lines += ["", "Plots and the full evaluation: `eval/report.md`, `eval/kl_distribution.png`, `eval/size_vs_kl.png`."]
    return "\n".join(lines)


def failed_gates(summary: dict) -> list[str]:
    """One line per failure, naming the variant and the gate."""
    out = []
    for v in summary["variants"]:
        for g in v["gates"]:
            if not g["passed"]:
                op = ">=" if g["gate"] == "min_top1" else ("is" if g["gate"] == "serving" else "<=")
                out.append(f"{v['name']}: gate {g['gate']} failed ({g['metric']} = {g['value']}, needs {op} "
                           f"{g['threshold']})")
    for d in summary.get("determinism") or []:
        if not d["identical"]:
            out.append(f"{d['variant']}: determinism failed (differing files: {', '.join(d['mismatched'])})")
    return out
