"""Where a checkpoint loses its accuracy: each decoder layer's share of the final KL.

One layer at a time is swapped back to the unquantised model's (the very module of the baseline, loaded by the
runtime as a dense model), the held-out KL is measured again, and the layer's contribution is how much KL the
swap removes. Layers interact, so the contributions need not add up to the whole checkpoint's KL: the report
gives their sum next to it, and their ratio, so a reader sees how far the per-layer view explains the total.

Works on any architecture the runtime loads (the decoder layers are found through the model's adapter); a MoE
layer counts as one layer, experts and router together.
"""

from __future__ import annotations

from functools import reduce
from typing import Callable

import torch
from torch import nn

from quantkit.errors import InputError


def decoder_layers(model: nn.Module, layers_path: str) -> nn.ModuleList:
    try:
        layers = reduce(getattr, layers_path.split("."), model)
    except AttributeError:
        raise InputError(f"--attribution: cannot find the decoder layers at {layers_path}") from None
    if not isinstance(layers, nn.ModuleList):
        raise InputError(f"--attribution: {layers_path} is not a list of decoder layers")
    return layers


def layer_attribution(quantised: nn.Module, baseline: nn.Module, layers_path: str,
                      kl_of: Callable[[], float], on_layer: Callable[[int], None] | None = None) -> dict:
    """`kl_of()` measures the held-out mean KL of `quantised` against the baseline as it is at the call. Each
    layer of `quantised` is replaced by `baseline`'s for one measurement, then put back."""
    q_layers, b_layers = decoder_layers(quantised, layers_path), decoder_layers(baseline, layers_path)
    if len(q_layers) != len(b_layers):
        raise InputError(f"--attribution: the checkpoint has {len(q_layers)} decoder layers, the baseline "
                         f"{len(b_layers)}; attribution swaps layers between the two, so they must match")
    full = kl_of()
    rows = []
    for i in range(len(q_layers)):
        own = q_layers[i]
        q_layers[i] = b_layers[i]
        try:
            without = kl_of()
        finally:
            q_layers[i] = own
        rows.append({"layer": i, "kl_without": without, "contribution": full - without})
        if on_layer is not None:
            on_layer(i)
    total = sum(r["contribution"] for r in rows)
    for r in rows:
        r["share"] = r["contribution"] / full if full > 0 else 0.0
    return {"kl_mean": full, "layers": rows, "sum_of_contributions": total,
            "explained": total / full if full > 0 else None}


def attribution_figure(plt, name: str, attribution: dict):
    rows = attribution["layers"]
    fig, ax = plt.subplots(figsize=(min(12, 3 + 0.25 * len(rows)), 4))
    ax.bar([r["layer"] for r in rows], [r["contribution"] for r in rows], color="#4c72b0")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xlabel("decoder layer (restored to the baseline's)")
    ax.set_ylabel("KL removed (nats / token)")
    explained = attribution.get("explained")
    ax.set_title(f"{name}: KL {attribution['kl_mean']:.4f}, layers' sum "
                 f"{attribution['sum_of_contributions']:.4f}" + (f" ({explained:.0%})" if explained else ""))
    fig.tight_layout()
    return fig
