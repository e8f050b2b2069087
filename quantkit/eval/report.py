"""Reports: report.json (everything), report.md (tables of the same numbers) and PNG plots; a rich table."""

from __future__ import annotations

import json
from pathlib import Path

QUALITY_COLUMNS = ("ppl", "ppl_base", "ppl_increase_pct", "kl_mean", "kl_median", "kl_p90", "kl_p99", "kl_max",
                   "top1_agree", "delta_p_mean", "delta_p_rms", "size_bytes", "bits_per_weight")
THROUGHPUT_COLUMNS = ("prefill_tok_s", "decode_tok_s_b1", "decode_tok_s_b8", "ttft_ms", "peak_memory_bytes")


def _cell(v) -> str:
    return "-" if v is None else str(v)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _rows_with_baseline(report: dict) -> list[tuple[str, dict]]:
    return [("baseline", report["baseline"])] + [(r["checkpoint"], r) for r in report["results"]]


def render_markdown(report: dict) -> str:
    data = report["data"]
    out = ["# quantkit eval", "",
           f"Baseline `{report['baseline']['model']}` (perplexity {report['baseline']['ppl']}); data `{data['source']}` "
           f"split {data['split']}, {data['num_samples']} x {data['seq_len']} tokens ({data['tokens_scored']} scored), "
           f"device {report['device']}.", "", "## Quality", ""]
    out += _table(["checkpoint", *QUALITY_COLUMNS], [[r["checkpoint"], *(r.get(c) for c in QUALITY_COLUMNS)]
                                                     for r in report["results"]])
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
        out += _table(["model", *THROUGHPUT_COLUMNS], [[name, *(r.get("throughput", {}).get(c) for c in THROUGHPUT_COLUMNS)]
                                                     for name, r in _rows_with_baseline(report)])
    if report["gates"]:
        out += ["## Gates", ""]
        out += _table(["checkpoint", "gate", "metric", "threshold", "value", "passed"],
                      [[g["checkpoint"], g["gate"], g["metric"], g["threshold"], g["value"], g["passed"]]
                       for g in report["gates"]])
    return "\n".join(out)


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

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in report["results"]:
        ax.scatter(r["size_bytes"] / 1e6, r["kl_mean"])
        ax.annotate(Path(r["checkpoint"]).name, (r["size_bytes"] / 1e6, r["kl_mean"]), fontsize=8)
    ax.set_xlabel("size [MB]")
    ax.set_ylabel("mean KL [nats]")
    ax.set_title("size against KL")
    fig.tight_layout()
    fig.savefig(folder / "size_vs_kl.png", dpi=110)
    written.append("size_vs_kl.png")
    plt.close(fig)

    rows = [(name, r["throughput"]) for name, r in _rows_with_baseline(report) if "throughput" in r]
    if rows:
        metrics = ("prefill_tok_s", "decode_tok_s_b1", "decode_tok_s_b8")
        fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 4))
        for ax, metric in zip(axes, metrics):
            ax.bar([Path(n).name for n, _ in rows], [t.get(metric, 0) for _, t in rows])
            ax.set_title(metric)
            ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        fig.tight_layout()
        fig.savefig(folder / "throughput.png", dpi=110)
        written.append("throughput.png")
        plt.close(fig)
    return written


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
    for name, r in _rows_with_baseline(report):
        for task, m in r.get("tasks", {}).items():
            console.print(f"{name}: task {task} acc {m['acc']} acc_norm {m['acc_norm']} (n={m['n']})")
        if "throughput" in r:
            t = r["throughput"]
            console.print(f"{name}: prefill {t['prefill_tok_s']} tok/s, decode b1 {t.get('decode_tok_s_b1')} tok/s, "
                          f"b8 {t.get('decode_tok_s_b8')} tok/s, ttft {t['ttft_ms']} ms, peak {t['peak_memory_bytes'] / 1e6:.0f} MB")
    for g in report["gates"]:
        mark = "[green]pass[/]" if g["passed"] else "[bold red]FAIL[/]"
        console.print(f"gate {g['gate']} on {g['checkpoint']}: {g['metric']} = {g['value']} (threshold {g['threshold']}) {mark}")
