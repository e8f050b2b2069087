"""Reports: report.json (everything), report.md (tables of the same numbers) and PNG plots; a rich table."""

from __future__ import annotations

import json
from pathlib import Path

QUALITY_COLUMNS = ("ppl", "ppl_base", "ppl_increase_pct", "kl_mean", "kl_median", "kl_p90", "kl_p99", "kl_max",
                   "top1_agree", "delta_p_mean", "delta_p_rms", "size_bytes", "resident_weight_bytes", "bits_per_weight")
THROUGHPUT_COLUMNS = ("prefill_tok_s", "decode_tok_s_b1", "decode_tok_s_b8", "ttft_ms", "peak_memory_bytes",
                      "resident_weight_bytes")


def kernels_cell(kernels: dict | None) -> str:
    """{"w4a16": {"torch-int4pack": 210}} -> "w4a16: torch-int4pack x210" (linears served per kernel)."""
    if not kernels:
        return "-"
    return "; ".join(f"{kind}: " + ", ".join(f"{name} x{n}" for name, n in by.items()) for kind, by in kernels.items())


SPEC_COLUMNS = ("draft", "tree", "temperature", "acceptance_rate", "mean_accepted_length", "tokens_per_s",
                "plain_tokens_per_s", "speedup", "identical_to_plain", "diverged_prompts", "draft_seconds",
                "verify_seconds", "draft_bytes_ratio")


def _draft_bytes(m: dict) -> str:
    if m.get("draft_bytes_ratio") is None:
        return ""
    return (f"; the draft reads {m['draft_bytes_per_token'] / 1e6:.1f} MB per step, {m['draft_bytes_ratio']:.2f}x "
            f"the target's {m['target_bytes_per_token'] / 1e6:.1f} MB")


def _divergence(m: dict) -> str:
    """Where greedy outputs left plain decoding's, e.g. ' (2 of 8 prompts diverge, first at generated tokens 37, 51)'."""
    firsts = [d for d in m.get("first_divergence") or [] if d is not None]
    if not firsts:
        return ""
    return f" ({len(firsts)} of {m.get('prompts', '?')} prompts diverge, first at generated tokens " + \
        ", ".join(map(str, firsts)) + ")"


def speculative_rows(report: dict) -> list[tuple[str, dict]]:
    """(target, metrics) of every speculative run: --speculative per checkpoint, and the --speculative-grid."""
    rows = [(r["checkpoint"], r["speculative"]) for r in report["results"] if "speculative" in r]
    return rows + [(g["target"], g) for g in report.get("speculative_grid", [])]


def _cell(v) -> str:
    return "-" if v is None else str(v)


def _overlap(moe: dict) -> str:
    """The routing overlap, or why it was not measured (never a bare None)."""
    v = moe.get("routing_topk_overlap")
    return str(v) if v is not None else f"not measured ({moe.get('routing_note', 'no baseline routing')})"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def throughput_columns(report: dict) -> tuple[str, ...]:
    """quantkit's runtime measures prefill / decode / TTFT; `--engine vllm` measures generation throughput."""
    keys = {k for _, r in _rows_with_baseline(report) for k in r.get("throughput", {})}
    return tuple(c for c in THROUGHPUT_COLUMNS if c in keys) or tuple(sorted(keys))


def _rows_with_baseline(report: dict) -> list[tuple[str, dict]]:
    return [("baseline", report["baseline"])] + [(r["checkpoint"], r) for r in report["results"]]


def render_markdown(report: dict) -> str:
    data = report["data"]
    out = ["# quantkit eval", "",
           f"Baseline `{report['baseline']['model']}` (perplexity {report['baseline']['ppl']}); data `{data['source']}` "
           f"split {data['split']}, {data['num_samples']} x {data['seq_len']} tokens ({data['tokens_scored']} scored), "
           f"device {report['device']}.", ""]
    if report.get("engine", {}).get("name") == "vllm":
        e = report["engine"]
        out += [f"Scored by vLLM (tensor-parallel size {e['tensor_parallel_size']}). KL: top-{e['top_logprobs']} "
                f"{e['kl']}.", ""]
    out += ["## Quality", ""]
    out += _table(["checkpoint", *QUALITY_COLUMNS], [[r["checkpoint"], *(r.get(c) for c in QUALITY_COLUMNS)]
                                                     for r in report["results"]])
    out += ["## Kernels (quantised linears served by each)", ""]
    out += _table(["checkpoint", "kernels"], [[r["checkpoint"], kernels_cell(r.get("kernels"))] for r in report["results"]])
    dp_cols = sorted((k for k in report["results"][0] if k.startswith("delta_p_p")), key=lambda k: int(k[9:]))
    out += ["## Delta-p percentiles", ""]
    out += _table(["checkpoint", "delta_p_min", *dp_cols, "delta_p_max"],
                  [[r["checkpoint"], r["delta_p_min"], *(r[c] for c in dp_cols), r["delta_p_max"]] for r in report["results"]])
    task_names = sorted({t for _, r in _rows_with_baseline(report) for t in r.get("tasks", {})})
    if task_names:
        out += ["## Tasks (acc / acc_norm)", ""]
        out += _table(["model", *[f"{t} acc" for t in task_names], *[f"{t} acc_norm" for t in task_names]],
                      [[name, *(r.get("tasks", {}).get(t, {}).get("acc") for t in task_names),
                        *(r.get("tasks", {}).get(t, {}).get("acc_norm") for t in task_names)]
                       for name, r in _rows_with_baseline(report)])
    if any("throughput" in r for _, r in _rows_with_baseline(report)):
        out += ["## Throughput", ""]
        cols = throughput_columns(report)
        out += _table(["model", *cols], [[name, *(r.get("throughput", {}).get(c) for c in cols)]
                                         for name, r in _rows_with_baseline(report)])
    spec = speculative_rows(report)
    if spec:
        out += ["## Speculative decoding", ""]
        out += _table(["target", *SPEC_COLUMNS], [[t, *(m.get(c) for c in SPEC_COLUMNS)] for t, m in spec])
        depth = max(len(m["per_position_acceptance"]) for _, m in spec)
        out += _table(["target", "draft", *[f"pos {d + 1}" for d in range(depth)]],
                      [[t, m["draft"], *(m["per_position_acceptance"] + [None] * depth)[:depth]] for t, m in spec])
    out += _moe_markdown(report)
    out += _attribution_markdown(report)
    if report["gates"]:
        out += ["## Gates", ""]
        out += _table(["checkpoint", "gate", "metric", "threshold", "value", "passed"],
                      [[g["checkpoint"], g["gate"], g["metric"], g["threshold"], g["value"], g["passed"]]
                       for g in report["gates"]])
    return "\n".join(out)


def _attribution_markdown(report: dict) -> list[str]:
    out = []
    for r in report["results"]:
        a = r.get("attribution")
        if not a:
            continue
        explained = a.get("explained")
        out += [f"## Attribution: {r['checkpoint']}", "",
                f"KL {a['kl_mean']}; each layer restored to the baseline's removes the KL below. The layers' sum is "
                f"{a['sum_of_contributions']}" + (f", {explained:.1%} of the whole" if explained is not None else "")
                + " (layers interact: the sum need not equal the whole).", ""]
        out += _table(["layer", "KL without it", "contribution", "share"],
                      [[x["layer"], x["kl_without"], x["contribution"], x["share"]] for x in a["layers"]])
    return out


def _moe_markdown(report: dict) -> list[str]:
    rows = [(r["checkpoint"], r["moe"]) for r in report["results"] if "moe" in r]
    if not rows:
        return []
    out = ["## MoE routing", ""]
    out += _table(["checkpoint", "experts", "top-k", "routing_topk_overlap", "max_over_mean_load",
                   "bias: max/mean without", "with", "bias: KL without", "with"],
                  [[name, m["num_experts"], m["top_k"], _overlap(m), m["max_over_mean_load"],
                    m["bias_balancing"]["max_over_mean_load"]["without"], m["bias_balancing"]["max_over_mean_load"]["with"],
                    m["bias_balancing"]["kl"]["without"], m["bias_balancing"]["kl"]["with"]] for name, m in rows])
    out += ["### Per layer", ""]
    out += _table(["checkpoint", "layer", "max_over_mean_load", "load_entropy", "load_entropy_max", "score_entropy",
                   "topk_overlap"],
                  [[name, r["layer"], r["max_over_mean_load"], r["load_entropy"], r["load_entropy_max"],
                    r["score_entropy"], m["drift_per_layer"].get(str(r["layer"]))]
                   for name, m in rows for r in m["layers"]])
    out += ["### Capacity-aware inference (C = ceil(gamma T k / E) per call)", ""]
    out += _table(["checkpoint", "gamma", "policy", "capacity", "max load before", "after", "reduction",
                   "dropped", "rerouted", "KL", "KL change"],
                  [[name, c["gamma"], c["policy"], c["capacity"], c["max_load_before"], c["max_load_after"],
                    c["max_load_reduction"], c["dropped_frac"], c["rerouted_frac"], c["kl"], c["kl_change"]]
                   for name, m in rows for c in m["capacity"]])
    if any(m["offload"] for _, m in rows):
        out += ["### Expert offloading", ""]
        cols = ("policy", "cache", "reads", "hit_rate", "prefetch_fidelity", "bytes_moved", "decode_tok_s")
        out += _table(["checkpoint", *cols], [[name, *(o.get(c) for c in cols)] for name, m in rows for o in m["offload"]])
    return out


def _integer_axis(axis, lo: int, hi: int) -> None:
    """Ticks on whole numbers only: every one over a short range (matplotlib's integer locator gives up on a
    range of one value and ticks 3.8, 4.0, 4.2), at most ten otherwise."""
    from matplotlib.ticker import FixedLocator, MaxNLocator

    axis.set_major_locator(FixedLocator(range(lo, hi + 1)) if hi - lo < 10 else MaxNLocator(nbins=10, integer=True))


def offload_figure(plt, offload: list[dict], title: str):
    """Hit rate (0..1) against the experts cached per layer (an integer axis, however few values it has)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    sized = [o for o in offload if o["cache"] is not None]
    caches = [o["cache"] for o in sized] or [0]

    def label(o):  # rows read from storage make the same decisions; they are told apart for their speed
        return o["policy"] + (f" ({o['reads']})" if o.get("reads", "page-cache") != "page-cache" else "")

    for name in sorted({label(o) for o in sized}):
        pts = sorted((o["cache"], o["hit_rate"]) for o in sized if label(o) == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    for o in offload:
        if o["cache"] is None:  # every expert resident: no cache size, the hit rate over the whole range
            ax.plot([min(caches), max(caches)], [o["hit_rate"]] * 2, linestyle="--", color="grey", label=o["policy"])
    _integer_axis(ax.xaxis, min(caches), max(caches))
    ax.set_xlim(min(caches) - 0.5, max(caches) + 0.5)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("experts cached per layer")
    ax.set_ylabel("hit rate")
    ax.legend(fontsize=8)
    ax.set_title(f"offload hit rate: {title}")
    fig.tight_layout()
    return fig


def _moe_plots(folder: Path, report: dict, plt) -> list[str]:
    import numpy as np

    written = []
    for i, r in enumerate(report["results"]):
        m = r.get("moe")
        if not m:
            continue
        load = np.array([row["load"] for row in m["layers"]]) * m["num_experts"]  # 1 = balanced
        fig, ax = plt.subplots(figsize=(min(12, 2 + 0.25 * load.shape[1]), min(10, 1.5 + 0.25 * load.shape[0])))
        im = ax.imshow(load, aspect="auto", cmap="viridis")
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer (index in the model)")
        ax.set_yticks(range(load.shape[0]), [row["layer"] for row in m["layers"]], fontsize=6)
        ax.set_title(f"load per expert / mean: {Path(r['checkpoint']).name}")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        name = f"moe_load_{i}.png"
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        written.append(name)
        if m["offload"]:
            fig = offload_figure(plt, m["offload"], Path(r["checkpoint"]).name)
            name = f"moe_offload_{i}.png"
            fig.savefig(folder / name, dpi=110)
            plt.close(fig)
            written.append(name)
    return written


def write_plots(folder: Path, report: dict, token_kl: dict) -> list[str]:
    from quantkit.optional import require

    matplotlib = require("matplotlib", "eval --report")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, kl in token_kl.items():
        values = np.clip(kl.numpy().astype("float64"), 1e-9, None)
        ax.hist(values, bins=np.logspace(-9, max(1.0, np.log10(values.max()) + 0.1), 80), histtype="step",
                label=Path(name).name)
    ax.set_xscale("log")
    ax.set_xlabel("per-token KL(base || checkpoint) [nats]")
    ax.set_ylabel("tokens")
    ax.set_title("KL divergence distribution")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "kl_distribution.png", dpi=110)
    written.append("kl_distribution.png")
    plt.close(fig)

    fig = size_vs_kl_figure(plt, report)
    fig.savefig(folder / "size_vs_kl.png", dpi=110)
    written.append("size_vs_kl.png")
    plt.close(fig)

    rows = [(name, r["throughput"]) for name, r in _rows_with_baseline(report) if "throughput" in r]
    if rows:
        metrics = tuple(c for c in throughput_columns(report) if c.endswith("tok_s") or "_tok_s_" in c)
        fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 4))
        for ax, metric in zip(axes, metrics):
            ax.bar([Path(n).name for n, _ in rows], [t.get(metric, 0) for _, t in rows])
            ax.set_title(metric)
            ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        fig.tight_layout()
        fig.savefig(folder / "throughput.png", dpi=110)
        written.append("throughput.png")
        plt.close(fig)
    spec = speculative_rows(report)
    if spec:
        fig = acceptance_figure(plt, spec)
        fig.savefig(folder / "speculative_acceptance.png", dpi=110)
        written.append("speculative_acceptance.png")
        plt.close(fig)
    written += _moe_plots(folder, report, plt)
    from quantkit.eval.attribution import attribution_figure

    for i, r in enumerate(report["results"]):
        if r.get("attribution"):
            fig = attribution_figure(plt, Path(r["checkpoint"]).name, r["attribution"])
            name = f"attribution_{i}.png"
            fig.savefig(folder / name, dpi=110)
            written.append(name)
            plt.close(fig)
    return written


def size_vs_kl_figure(plt, report: dict):
    """Each checkpoint's weights against its mean KL, with the baseline at KL 0 as the reference point (one
    checkpoint alone would otherwise be a lone dot with nothing to compare it to)."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    base = report["baseline"]
    points = [(f"baseline {Path(str(base.get('model', ''))).name}", base.get("size_bytes"), 0.0)]
    points += [(Path(r["checkpoint"]).name, r["size_bytes"], r["kl_mean"]) for r in report["results"]]
    for i, (name, size, kl) in enumerate(points):
        if size is None or kl is None:
            continue
        ax.scatter(size / 1e6, kl, marker="s" if i == 0 else "o", color="black" if i == 0 else None, zorder=3)
        ax.annotate(name, (size / 1e6, kl), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.margins(x=0.15, y=0.15)
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    ax.set_xlabel("weights [MB]")
    ax.set_ylabel("mean KL [nats]")
    ax.set_title("size against KL (baseline: KL 0)")
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6))
    fig.tight_layout()
    return fig


def acceptance_figure(plt, spec: list):
    """Acceptance rate per draft position (an integer axis) for each target <- draft pair."""
    fig, ax = plt.subplots(figsize=(6, 4))
    longest = 1
    for target, m in spec:
        acc = m["per_position_acceptance"]
        longest = max(longest, len(acc))
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{Path(target).name} <- {Path(m['draft']).name}")
    _integer_axis(ax.xaxis, 1, longest)
    ax.set_xlim(0.5, longest + 0.5)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.set_title("speculative acceptance by draft position")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_report(folder: Path, report: dict, token_kl: dict) -> list[str]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (folder / "report.md").write_text(render_markdown(report) + "\n")
    return ["report.json", "report.md", *write_plots(folder, report, token_kl)]


def print_table(console, report: dict) -> None:
    from rich.table import Table

    table = Table(title=f"quantkit eval vs {report['baseline']['model']} (ppl {report['baseline']['ppl']})")
    cols = ("ppl", "kl_mean", "kl_p99", "top1_agree", "delta_p_mean", "bits_per_weight", "size_bytes")
    table.add_column("checkpoint")
    for c in cols:
        table.add_column(c, justify="right")
    for r in report["results"]:
        table.add_row(r["checkpoint"], *(_cell(r.get(c)) for c in cols))
    console.print(table)
    for r in report["results"]:
        if r.get("kernels"):
            console.print(f"{r['checkpoint']}: kernels {kernels_cell(r['kernels'])}; "
                          f"{r['resident_weight_bytes'] / 1e6:.1f} MB of weights resident", highlight=False)
    for name, r in _rows_with_baseline(report):
        for task, m in r.get("tasks", {}).items():
            console.print(f"{name}: task {task} acc {m['acc']} acc_norm {m['acc_norm']} (n={m['n']})")
        if "throughput" in r:
            t = r["throughput"]
            if "prefill_tok_s" not in t:  # measured by vLLM
                console.print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in t.items()), highlight=False)
                continue
            console.print(f"{name}: prefill {t['prefill_tok_s']} tok/s, decode b1 {t.get('decode_tok_s_b1')} tok/s, "
                          f"b8 {t.get('decode_tok_s_b8')} tok/s, ttft {t['ttft_ms']} ms, peak {t['peak_memory_bytes'] / 1e6:.0f} MB"
                          + (f", weights {t['resident_weight_bytes'] / 1e6:.1f} MB resident" if "resident_weight_bytes" in t else ""))
    for target, m in speculative_rows(report):
        console.print(f"{target} <- {m['draft']} ({m['tree']}, T={m['temperature']}): acceptance {m['acceptance_rate']}, "
                      f"mean accepted length {m['mean_accepted_length']}, {m['tokens_per_s']} tok/s vs plain "
                      f"{m['plain_tokens_per_s']} (speed-up {m['speedup']}x), identical to plain: {m['identical_to_plain']}"
                      + _divergence(m) + _draft_bytes(m))
    for r in report["results"]:
        m = r.get("moe")
        if m:
            d = {c["policy"]: c for c in m["capacity"] if c["gamma"] == 1.25}
            console.print(f"{r['checkpoint']}: MoE {m['num_experts']} experts top-{m['top_k']}: routing top-k overlap "
                          f"{_overlap(m)}, max/mean load {m['max_over_mean_load']}"
                          + (f", capacity 1.25 drop: max load -{100 * d['drop']['max_load_reduction']:.1f}% "
                             f"(KL {d['drop']['kl_change']:+.4g})" if "drop" in d else ""), highlight=False, soft_wrap=True)
            for o in m["offload"]:
                reads = f" from {o['reads']}" if o.get("reads") not in (None, "page-cache") else ""
                console.print(f"  offload {o['policy']} cache {o['cache']}{reads}: hit rate {o['hit_rate']}, "
                              f"{o['decode_tok_s']} tok/s", highlight=False)
    for g in report["gates"]:
        mark = "[green]pass[/]" if g["passed"] else "[bold red]FAIL[/]"
        console.print(f"gate {g['gate']} on {g['checkpoint']}: {g['metric']} = {g['value']} (threshold {g['threshold']}) {mark}")
