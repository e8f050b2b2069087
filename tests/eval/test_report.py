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
