"""`quantkit check-serving`: will vLLM load this checkpoint at a given tensor/pipeline-parallel size, GPU and
version, and which kernel family will it pick for each linear.

Every linear of the decoder layers is checked against vLLM's split rules (quantkit/serving/parallel.py) and,
when quantised, against the kernel tables (quantkit/serving/vllm_support.py): vLLM runs q/k/v and gate/up as
one merged linear, so a kernel sees their summed N per rank; MoE experts run in FusedMoE and get the split
rules only. Nothing is loaded but the safetensors headers (and the few `weight_shape` tensors).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import InputError
from quantkit.serving import vllm_support as vs
from quantkit.serving.parallel import Heads, QuantShape, merge_key, parallel_style, shard_sizes, split_problem

_EXPERT = re.compile(r"\.experts\.\d+\.")


@dataclass
class ServingTarget:
    tp: int = 1
    pp: int = 1
    gpu: str = "sm_90"  # sm_XY, or "cpu" for vLLM's CPU build
    vllm_version: str | None = None  # None: the version the facts were read from
    dtype: str | None = None  # activation dtype vLLM serves in (--dtype); None: the checkpoint's

    def platform(self) -> tuple[str, int | None]:
        g = self.gpu.lower().strip()
        if g == "cpu":
            return "cpu", None
        m = re.fullmatch(r"sm_?(\d+)(\d)a?", g)
        if not m:
            raise InputError(f"unknown --gpu {self.gpu!r}: use sm_80, sm_86, sm_89, sm_90, sm_100, ... or cpu")
        return "cuda", int(m.group(1)) * 10 + int(m.group(2))


def _family(fmt) -> str:
    w = fmt.weights
    if w.is_fp4:
        return "nvfp4" if w.fp4_global else "mxfp4"
    if w.type == "int" and fmt.input is not None and fmt.input.type == "float":
        return "w4afp8"
    if w.type == "float":
        return "fp8_block" if w.strategy == "block" else "fp8"
    return "int8" if fmt.input is not None else "wna16"


def _heads(config: dict) -> Heads | None:
    heads = config.get("num_attention_heads")
    if not heads or config.get("kv_lora_rank"):  # MLA: q/kv_b are split by heads via N, kv_a is replicated
        return None
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return Heads(heads, kv, head_dim)


def _linears(index) -> dict[str, tuple[int, int, bool]]:
    """module -> (out_features, in_features, quantised) for every 2-D linear weight inside decoder layers."""
    out: dict[str, tuple[int, int, bool]] = {}
    names = set(index.names())
    for name in names:
        if ".layers." not in name:
            continue
        if name.endswith(".weight_shape"):
            module = name[: -len(".weight_shape")]
            n, k = (int(x) for x in index.get(name).tolist())
            out[module] = (n, k, True)
        elif name.endswith(".weight") and len(index.tensors[name].shape) == 2:
            module = name[: -len(".weight")]
            if module in out:
                continue
            n, k = index.tensors[name].shape
            out[module] = (int(n), int(k), f"{module}.weight_scale" in names)
        elif name.endswith(".weight_packed") and f"{name[:-len('_packed')]}_shape" not in names \
                and index.tensors[name].dtype == "U8":  # fp4: two e2m1 values a byte, no weight_shape
            n, half = index.tensors[name].shape
            out[name[: -len(".weight_packed")]] = (int(n), 2 * int(half), True)
    return out


def check_serving(checkpoint: Path, target: ServingTarget) -> dict:
    """The report; when vLLM would not load the checkpoint, `fixes` lists the changes (serving options, or a
    re-quantisation) that the same check shows would make it load, and `problem_groups` the problems grouped."""
    from quantkit.runtime.model import check_model_folder, read_config

    folder = check_model_folder(Path(checkpoint), "checkpoint")
    config = read_config(folder)
    report = _check(folder, config, target)
    if not report["compatible"]:
        report["problem_groups"] = group_problems(report["problems"])
        report["fixes"] = _fixes(folder, config, target, report)
    return report


def group_problems(problems: list[dict]) -> list[dict]:
    """Problems with the same reason, one entry each: the tensors it covers with their layer numbers folded
    into ranges (`model.layers.0-29.mlp.down_proj`), in numeric order."""
    by_reason: dict[str, dict[str, set]] = {}
    for p in problems:
        m = re.search(r"\.layers\.(\d+)\.", p["tensor"])
        pattern = p["tensor"] if m is None else p["tensor"][:m.start()] + ".layers.{}." + p["tensor"][m.end():]
        by_reason.setdefault(p["reason"], {}).setdefault(pattern, set()).add(None if m is None else int(m.group(1)))
    out = []
    for reason, patterns in by_reason.items():
        names = [pat.format(_ranges(sorted(layers))) if "{}" in pat else pat for pat, layers in sorted(patterns.items())]
        out.append({"reason": reason, "tensors": names, "count": sum(len(v) for v in patterns.values())})
    return out


def _ranges(values: list[int]) -> str:
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _fixes(folder: Path, config: dict, target: ServingTarget, report: dict) -> list[str]:
    """Each candidate change is checked, not guessed: the serving options first (nothing to redo), then
    re-quantisations of the weights' layout (the tensor shapes stay; only the quantisation_config changes)."""
    import copy
    from dataclasses import replace

    fixes = []
    dtype = report["target"]["dtype"]
    for other in ("float16", "bfloat16"):
        if other != dtype and _check(folder, config, replace(target, dtype=other))["compatible"]:
            fixes.append(f"serve with --dtype {other}")
    for tp in range(target.tp - 1, 0, -1):
        if _check(folder, config, replace(target, tp=tp))["compatible"]:
            fixes.append(f"serve with --tensor-parallel-size {tp} (the largest that loads)")
            break
    qc = config.get("quantization_config")
    if not qc:
        return fixes
    def int_weights(change: dict):
        def edit(w: dict, a: dict) -> bool:
            if w.get("type") != "int" or all(w.get(k) == v for k, v in change.items()):
                return False
            w.update(change)
            return True
        return edit

    def fp8_dynamic(w: dict, a: dict) -> bool:
        if w.get("type") != "float" or not a or a.get("dynamic"):
            return False
        w.update(strategy="channel")
        a.update(dynamic=True, strategy="token")
        return True

    candidates = [("re-quantise with --group-size -1 (per-channel scales)", int_weights({"strategy": "channel", "group_size": None})),
                  ("re-quantise with --group-size 128", int_weights({"strategy": "group", "group_size": 128})),
                  ("re-quantise with --group-size 64", int_weights({"strategy": "group", "group_size": 64})),
                  ("re-quantise symmetric (no zero points)", int_weights({"symmetric": True})),
                  ("re-quantise with --actorder static (no g_idx)", int_weights({"actorder": "weight"})),
                  ("re-quantise with --scheme FP8_DYNAMIC (per-token activation scales)", fp8_dynamic)]
    for label, edit in candidates:
        changed = copy.deepcopy(config)
        groups = (changed["quantization_config"].get("config_groups") or {}).values()
        touched = [edit(g.setdefault("weights", {}) or {}, g.get("input_activations") or {}) for g in groups]
        if any(touched) and _check(folder, changed, target)["compatible"]:
            fixes.append(label)
    return fixes


def _check(folder: Path, config: dict, target: ServingTarget) -> dict:
    from quantkit.models.safetensors_index import SafetensorsIndex
    from quantkit.runtime.formats import parse_quantization_config

    if target.tp < 1 or target.pp < 1:
        raise InputError(f"--tp and --pp must be at least 1 (got tp={target.tp}, pp={target.pp})")
    platform, cc = target.platform()
    version = target.vllm_version or vs.FACTS_VLLM_VERSION
    if not vs.version_tuple(version):
        raise InputError(f"cannot read --vllm-version {target.vllm_version!r} (expected e.g. 0.15.1)")
    text = config.get("text_config") or config
    qc_raw = config.get("quantization_config")
    qc = parse_quantization_config(qc_raw, str(folder)) if qc_raw else None
    stored = str(text.get("torch_dtype") or config.get("torch_dtype") or text.get("dtype") or config.get("dtype")
                 or "bfloat16").replace("torch.", "")
    # vLLM's --dtype auto serves float16 and bfloat16 checkpoints as they are and narrows float32 ones.
    act_dtype = target.dtype or ("bfloat16" if stored == "float32" else stored)
    if act_dtype not in ("bfloat16", "float16"):
        raise InputError(f"unknown --dtype {act_dtype!r}: use bfloat16 or float16")
    index = SafetensorsIndex(folder)
    heads = _heads(text)
    problems: list[dict] = []
    warnings: list[dict] = []

    def problem(tensor: str, reason: str) -> None:
        problems.append({"tensor": tensor, "reason": reason})

    layers = text.get("num_hidden_layers") or 0
    if target.pp > max(layers, 1):
        problem("model.layers", f"pp={target.pp} exceeds the {layers} decoder layers")
    latent = text.get("kv_lora_rank")
    if latent:
        size = int(latent) + int(text.get("qk_rope_head_dim") or 0)
        if size not in vs.MLA_LATENT_SIZES:
            sizes = ", ".join(map(str, vs.MLA_LATENT_SIZES))
            problem("model.layers.*.self_attn",
                    f"MLA latent size {size} (kv_lora_rank {latent} + qk_rope_head_dim {size - int(latent)}) is not one "
                    f"vLLM's MLA attention takes ({sizes}); convert with --kv-lora-rank "
                    f"{' or '.join(str(s - size + int(latent)) for s in vs.MLA_LATENT_SIZES if s > size - int(latent))}")
    if latent and platform == "cpu":
        warnings.append({"tensor": "model.layers.*.self_attn",
                         "reason": "vLLM's CPU build computes the RoPE part of MLA attention differently from "
                                   "transformers (any DeepSeek-V3 model, measured on 0.32.0: "
                                   "benchmarks/results/mla_rope_isolation.md); expect other logits than transformers'"})
    archs = config.get("architectures") or []
    untied = [a for a in archs if a in vs.NEVER_TIED_ARCHITECTURES]
    if untied and config.get("tie_word_embeddings") and "lm_head.weight" not in index:
        problem("lm_head.weight", f"{untied[0]} in vLLM never ties lm_head to the embeddings: this tied checkpoint "
                                  "has no lm_head.weight, which vLLM leaves at zero (uniform logits); write the "
                                  "head out and set tie_word_embeddings false")
    if heads is not None and target.tp > 1 and heads.num_heads % target.tp:
        problem("model.layers.*.self_attn", f"{heads.num_heads} attention heads are not divisible by tp={target.tp}")

    linears = _linears(index)
    merged: dict[str, dict] = {}
    kernels: dict[tuple, dict] = {}
    families: dict[str, int] = {}
    for module, (n, k, quantised) in sorted(linears.items()):
        fmt = qc.format_for(module) if (qc is not None and quantised) else None
        quant = QuantShape.from_format(fmt) if fmt is not None else QuantShape("tensor")
        why = split_problem(module, n, k, quant, target.tp, heads)
        if why:
            problem(module, why)
            continue
        if fmt is None:
            continue
        if _EXPERT.search(module):  # FusedMoE: its own kernels (split rules checked above, kernels not)
            if platform == "cpu" and _family(fmt) == "wna16":
                problem(module, "vLLM's CPU build has no FusedMoE backend for WNA16 experts ('No WNA16 MoE backend "
                                "supports the deployment configuration', measured on 0.32.0)")
                continue
            families["FusedMoE (experts; kernel not checked)"] = families.get("FusedMoE (experts; kernel not checked)", 0) + 1
            continue
        n_part, k_part = shard_sizes(module, n, k, target.tp, heads)
        key = merge_key(module)
        name = key[0] if key else module
        entry = merged.setdefault(name, {"modules": [], "n_part": 0, "k_part": k_part, "k_full": k, "fmt": fmt,
                                         "split_k": parallel_style(module) == "row" and target.tp > 1})
        entry["modules"].append(module)
        entry["n_part"] += n_part

    for name, e in merged.items():
        fmt = e["fmt"]
        fam = _family(fmt)
        w = fmt.weights
        group = w.group_size if w.strategy == "group" else -1
        q = vs.KernelQuery(fam, platform, cc, w.num_bits, group, not w.symmetric, w.actorder == "group",
                           act_dtype, e["n_part"], e["k_part"], e["k_full"], e["split_k"])
        kernel = vs.choose_kernel(q)
        if kernel is None:
            where = "the CPU build" if platform == "cpu" else f"sm_{cc}"
            problem(name, f"no vLLM {fam} kernel on {where} for N/rank={e['n_part']} K/rank="
                                     f"{e['k_part']}{'' if group == -1 else f' group {group}'} {act_dtype}: "
                                     + "; ".join(q.rejected or ["none registered for this platform"]))
            continue
        label = kernel.name + (" (weight-only)" if kernel.weight_only else "")
        families[label] = families.get(label, 0) + len(e["modules"])
        shape_key = (label, e["n_part"], e["k_part"])
        kernels.setdefault(shape_key, {"kernel": label, "n_part": e["n_part"], "k_part": e["k_part"], "linears": 0})
        kernels[shape_key]["linears"] += len(e["modules"])

    _check_features(qc, platform, cc, version, target, problem, warnings)
    return {
        "checkpoint": str(folder),
        "compatible": not problems,
        "problems": problems,
        "warnings": warnings,
        "target": {"tp": target.tp, "pp": target.pp, "platform": platform, "gpu": target.gpu,
                   "compute_capability": cc, "vllm_version": version, "dtype": act_dtype},
        "kernels": sorted(kernels.values(), key=lambda r: (r["kernel"], r["n_part"], r["k_part"])),
        "kernel_families": families,
        "linears_checked": len(linears),
        "facts": {"vllm_version": vs.FACTS_VLLM_VERSION, "source": vs.FACTS_SOURCE},
    }


def _check_features(qc, platform: str, cc: int | None, version: str, target: ServingTarget, problem, warnings) -> None:
    if qc is None:
        return
    present = set()
    for _, fmt in qc.groups:
        if fmt.weights.type == "int" and not fmt.weights.symmetric:
            present.add("zero_points")
        if fmt.weights.actorder == "group":
            present.add("actorder_group")
        if fmt.weights.strategy == "block" and platform == "cuda" and cc is not None and cc < 89:
            present.add("fp8_block_below_sm89")
        if fmt.weights.type == "float" and fmt.input is not None and not fmt.input.dynamic:
            present.add("fp8_static_activations")
    for feat in vs.FEATURES:
        if feat.key not in present:
            continue
        if platform in feat.refused_on:
            problem("quantization_config", f"{feat.description} does not run on the {platform} build ({feat.source})")
            continue
        if feat.min_version and platform in feat.platforms and \
                vs.version_tuple(version) < vs.version_tuple(feat.min_version):
            problem("quantization_config", f"{feat.description} needs vLLM >= {feat.min_version} "
                                           f"(target {version}; {feat.source})")
        if feat.removed_in and vs.version_tuple(version) >= vs.version_tuple(feat.removed_in):
            problem("quantization_config", f"{feat.description} is refused from vLLM {feat.removed_in} on "
                                           f"(target {version}; {feat.source})")
        elif feat.deprecated:
            warnings.append({"tensor": "quantization_config", "reason": f"{feat.description}: {feat.deprecated}"})


def load_in_vllm(checkpoint: Path, report: dict, python: str | None = None) -> dict:
    """Load the checkpoint in vLLM (the build `python` runs: a CPU build checks the CPU rules, a GPU build the
    GPU's) and score 16 tokens of text. Returns {loaded, error, agrees_with_rules, vllm_version}; vLLM's
    refusal is its own reason, in one line."""
    from types import SimpleNamespace

    from quantkit.errors import RunError
    from quantkit.eval.vllm_engine import score, vllm_python
    from quantkit.runtime.model import check_model_folder

    folder = check_model_folder(Path(checkpoint), "checkpoint")
    interpreter = vllm_python(python)
    ids = list(range(1, 17))
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(str(folder)).encode("In the beginning God created the heaven and the earth.")[:16]
    except Exception:  # noqa: BLE001 - any 16 ids in range serve to prove the load
        pass
    opts = SimpleNamespace(top_logprobs=1, tensor_parallel_size=report["target"]["tp"], throughput=False)
    try:
        res = score(interpreter, folder, [ids], opts, report["target"]["dtype"])
        out = {"loaded": True, "error": None, "vllm_version": res.get("vllm_version")}
    except RunError as exc:
        out = {"loaded": False, "error": str(exc).split(": ", 1)[-1], "vllm_version": None}
    out["agrees_with_rules"] = out["loaded"] == report["compatible"]
    return out
