"""What the terminal and Markdown reports print for values that were not measured."""

from rich.console import Console

from quantkit.eval.report import print_table


def _report(moe: dict) -> dict:
    row = {"checkpoint": "ckpt", "ppl": 10.0, "kl_mean": 0.01, "moe": moe}
    return {"baseline": {"model": "base", "ppl": 9.9}, "results": [row], "gates": []}


def test_an_unmeasured_routing_overlap_says_why_instead_of_none():
    moe = {"num_experts": 4, "top_k": 2, "routing_topk_overlap": None, "max_over_mean_load": 1.2,
           "routing_note": "baseline is not an MoE with the same experts", "capacity": [], "offload": []}
    console = Console(record=True, width=300)
    print_table(console, _report(moe))
    text = console.export_text()
    assert "None" not in text
    assert "routing top-k overlap not measured (baseline is not an MoE with the same experts)" in text
    console = Console(record=True, width=300)
    print_table(console, _report({**moe, "routing_topk_overlap": 0.875}))
    assert "routing top-k overlap 0.875," in console.export_text()


import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from quantkit.eval.report import acceptance_figure, offload_figure, size_vs_kl_figure  # noqa: E402


def _points_inside(ax) -> bool:
    """Every plotted point (lines and scatter) lies within the axes' limits."""
    (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
    pts = [xy for line in ax.get_lines() for xy in line.get_xydata()]
    pts += [xy for coll in ax.collections for xy in coll.get_offsets()]
    return bool(pts) and all(x0 <= x <= x1 and y0 <= y <= y1 for x, y in pts)


def _integer_ticks(ax) -> bool:
    lo, hi = sorted(ax.get_xlim())
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    return bool(ticks) and all(float(t).is_integer() for t in ticks)


@pytest.mark.parametrize("n", [1, 3])
def test_size_against_kl_has_the_baseline_point_and_every_checkpoint(n):
    report = {"baseline": {"model": "/models/base", "size_bytes": 270e6},
              "results": [{"checkpoint": f"/ckpt/c{i}", "size_bytes": (110 + 40 * i) * 1e6, "kl_mean": 0.05 / (i + 1)}
                          for i in range(n)]}
    fig = size_vs_kl_figure(plt, report)
    ax = fig.axes[0]
    offsets = [tuple(o) for c in ax.collections for o in c.get_offsets()]
    assert (270.0, 0.0) in offsets and len(offsets) == n + 1
    assert _points_inside(ax)
    assert {t.get_text() for t in ax.texts} == {"baseline base", *(f"c{i}" for i in range(n))}
    plt.close(fig)


@pytest.mark.parametrize("n", [1, 3])
def test_acceptance_and_offload_axes_are_integer_and_hold_every_point(n):
    spec = [(f"/t{i}", {"draft": f"/d{i}", "per_position_acceptance": [0.9, 0.7, 0.4][: i + 1]}) for i in range(n)]
    fig = acceptance_figure(plt, spec)
    ax = fig.axes[0]
    assert _integer_ticks(ax) and _points_inside(ax)
    assert len(ax.get_legend().get_texts()) == n
    plt.close(fig)
    offload = [{"policy": p, "cache": c, "hit_rate": h} for p in ("lru", "lfu")[:n] for c, h in ((4, 0.97),)]
    offload += [{"policy": "lru", "cache": c, "hit_rate": 1.0} for c in range(5, 5 + n - 1)]
    offload += [{"policy": "resident", "cache": None, "hit_rate": 1.0}]  # what eval --moe reports first
    fig = offload_figure(plt, offload, "ckpt")
    ax = fig.axes[0]
    assert _integer_ticks(ax) and _points_inside(ax)
    assert len(ax.get_legend().get_texts()) == len({o["policy"] for o in offload})
    plt.close(fig)
