"""How much KL each quantisation choice of each linear adds to the model's output, one decoder layer in memory
at a time.

For a small change of the weights the KL between the model's next-token distributions and the changed model's is
a quadratic form in the Fisher information: KL ~ 1/2 E_y[(d log p(y) / dW . dW)^2], with y drawn from the model's
own distribution. The score of a whole sequence with y drawn independently at every position is a sum of
zero-mean terms, so the square of the sequence's score is an unbiased estimate of the sum over its positions.
The score never needs a weight gradient: for a linear computing Y from X, d log p / dW . dW equals the sum over
tokens of dlogp/dY . dY, where dY is what the linear computes quantised (weights, and activations where the scheme
quantises them) minus what it computes. So each choice costs one extra matmul per calibration batch.

That sequence-level estimate is unbiased but noisy: one squared score per sequence and draw, about sqrt(2 / (samples
* draws)) relative. An allocation that picks, per linear, the choice with the lowest estimate picks the ones whose
noise ran low, and the plan it promises is not the plan it gets (benchmarks/results/mixed_estimate.md scores plans
on independent samples). The token-level sum of squared scores (the square summed over positions instead of the sum
squared) has thousands of terms and next to no noise, but misses how the positions' errors add up, which depends on
the linear, not much on its choice. So the default ("pooled") takes each linear's level from the sequence estimate
summed over its choices, and how its choices differ from the token-level sums: estimate_c = token_c * sum(sequence) /
sum(token). "sequence" keeps the plain one.

What "quantised" means is the run's method's: `Method.preview` gives the weight it would store under each choice
(RTN's importance-weighted scale search, GPTQ's solve), from statistics of the linear's input on the same samples
(its mean squares, or its Hessian), gathered one layer at a time in a forward pass before that layer's backward.
Those statistics come from the next `samples` sequences, not the ones the KL is measured on: a preview fitted to
the very tokens that score it (GPTQ's solve above all) looks better than it will on any other text, and the
allocation would favour the choices that overfit most. Without enough sequences they share the KL's.

The pass streams: a forward stores every layer's input (one generation of hidden states per layer), the output
head gives each draw's gradient at the top, then the layers are materialised again from the last to the first,
each run once forward with its inputs requiring grad and once backward per draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantkit.models.loader import ModelHandle
from quantkit.pipeline.capture import capture_layer_inputs, run_layer
from quantkit.pipeline.reference import output_logits
from quantkit.quant.activations import quantize_activation
from quantkit.quant.args import QuantArgs
from quantkit.quant.fp4 import nvfp4_global_scale
from quantkit.quant.fp8 import scale_from_absmax
from quantkit.quant.schemes import Scheme
from quantkit.quant.weights import round_trip
from quantkit.recipe import ESTIMATES


@dataclass(frozen=True)
class SensitivityOptions:
    samples: int = 8  # calibration sequences (the first ones of the run's set)
    draws: int = 4  # next-token draws per sequence: the estimate's relative noise is about sqrt(2 / (samples*draws))
    batch_size: int = 1
    seed: int = 0
    estimate: str = "pooled"  # or "sequence" (see the module docstring)

    def __post_init__(self) -> None:
        if self.estimate not in ESTIMATES:
            raise ValueError(f"estimate must be one of {', '.join(ESTIMATES)}, got {self.estimate!r}")


def _fake_inputs(x: torch.Tensor, acts: QuantArgs | None) -> torch.Tensor:
    """The linear's input as the scheme's consumer sees it. A static scale is taken from this batch's absmax
    (the run calibrates it on the whole set; for an estimate the batch's is close enough)."""
    if acts is None:
        return x
    if acts.fp4_global:
        return quantize_activation(x, acts, input_global_scale=nvfp4_global_scale(x.abs().amax()))
    if acts.dynamic or acts.is_fp4:
        return quantize_activation(x, acts)
    return quantize_activation(x, acts, scale_from_absmax(x.abs().amax().reshape(1), acts.half_range))


def _preview(method, weight: torch.Tensor, args: QuantArgs, stats, weight_dtype: torch.dtype) -> torch.Tensor:
    if method is None:
        return round_trip(weight, args, weight_dtype)
    return method.preview(weight, args, stats, weight_dtype)


def _top_gradients(handle: ModelHandle, hidden: list[torch.Tensor], options: SensitivityOptions,
                   device: str) -> list[torch.Tensor]:
    """Per batch, [draws, *h.shape]: the gradient of the sampled tokens' log-likelihood at the last hidden state."""
    gen = torch.Generator(device=device).manual_seed(options.seed)
    grads = []
    with output_logits(handle, torch.float32, device) as output:
        for h in hidden:
            h = h.detach().requires_grad_(True)
            with torch.enable_grad():
                logp = torch.log_softmax(output(h), dim=-1)
                probs = logp.detach().exp().reshape(-1, logp.shape[-1])
                per_draw = []
                for d in range(options.draws):
                    y = torch.multinomial(probs, 1, generator=gen).reshape(logp.shape[:-1] + (1,))
                    (g,) = torch.autograd.grad(logp.gather(-1, y).sum(), h, retain_graph=d < options.draws - 1)
                    per_draw.append(g)
            grads.append(torch.stack(per_draw))
            del logp, probs
    return grads


def _input_stats(layer, modules: dict, wanted: dict, hidden: list, calls: list, i: int, kind: str | None) -> dict:
    """PreviewStats of each wanted linear's input over the batches (None without a kind)."""
    if kind is None:
        return {}
    from quantkit.methods.base import PreviewStats
    from quantkit.quant.hessian import accumulate_hessian, complete_hessian

    sums: dict[str, list] = {}

    def hook(local):
        def fn(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            acc = sums.setdefault(local, [0, torch.zeros(x.shape[-1], dtype=torch.float64, device=x.device), None])
            acc[0] += x.shape[0]
            acc[1] += x.pow(2).sum(0).double()
            if kind == "hessian":  # summed as the run's GPTQ sums it, so a preview solves the run's problem
                if acc[2] is None:
                    acc[2] = torch.zeros(x.shape[-1], x.shape[-1], dtype=torch.float64, device=x.device)
                accumulate_hessian(acc[2], x)
        return fn

    handles = [modules[local].register_forward_pre_hook(hook(local)) for local in wanted]
    try:
        with torch.no_grad():
            for b, h in enumerate(hidden):
                run_layer(layer, h, calls[b][i])
    finally:
        for hd in handles:
            hd.remove()
    return {local: PreviewStats(n, (sq / max(n, 1)).float(),
                                None if xtx is None else (complete_hessian(xtx) * (2.0 / max(n, 1))).float())
            for local, (n, sq, xtx) in sums.items()}


def linear_sensitivity(handle: ModelHandle, plans: list, choices: dict[str, list[Scheme]], input_ids: torch.Tensor,
                       weight_dtype: torch.dtype, device: str = "cpu",
                       options: SensitivityOptions = SensitivityOptions(), method=None,
                       on_layer=None) -> dict[str, list[float]]:
    """Estimated KL (nats per token) each choice of each linear adds on its own, keyed by checkpoint name in the
    order of `choices[name]`. `plans`: the run's LayerPlans (their targets are the linears measured); `method`:
    the run's quantising Method, whose `preview` gives each choice's stored weight (None: round to nearest);
    `on_layer()` is called once per layer of the backward sweep (progress)."""
    both = sensitivity_sums(handle, plans, choices, input_ids, weight_dtype, device, options, method, on_layer)
    if options.estimate == "sequence":
        return both["sequence"]
    return {ckpt: pooled_estimate(vals, both["token"][ckpt]) for ckpt, vals in both["sequence"].items()}


def pooled_estimate(sequence: list[float], token: list[float]) -> list[float]:
    """One linear's choices: the level of the sequence estimates, the differences of the token-level ones."""
    total = sum(token)
    if total <= 0:
        return list(sequence)
    level = sum(sequence) / total
    return [t * level for t in token]


def sensitivity_sums(handle: ModelHandle, plans: list, choices: dict[str, list[Scheme]], input_ids: torch.Tensor,
                     weight_dtype: torch.dtype, device: str = "cpu",
                     options: SensitivityOptions = SensitivityOptions(), method=None,
                     on_layer=None) -> dict[str, dict[str, list[float]]]:
    """Both estimates of `linear_sensitivity` from one pass: {"sequence": the unbiased sequence-level estimate,
    "token": the token-level sums of squares on the same scale}."""
    ids = input_ids[: options.samples]
    tokens = ids.numel()
    kind = getattr(method, "preview_stats", None)
    held_out = input_ids[options.samples : 2 * options.samples] if kind else input_ids[:0]
    hidden, calls = capture_layer_inputs(handle, ids, options.batch_size, device, torch.float32)
    inputs = [hidden]
    stat_inputs, stat_calls = [[]], calls
    if len(held_out):
        stat_hidden, stat_calls = capture_layer_inputs(handle, held_out, options.batch_size, device, torch.float32)
        stat_inputs = [stat_hidden]
    with torch.no_grad():
        for i in range(handle.num_layers):
            layer = handle.materialize_layer(i, torch.float32, device)
            inputs.append([run_layer(layer, h, calls[b][i]) for b, h in enumerate(inputs[-1])])
            if len(held_out) and i + 1 < handle.num_layers:
                stat_inputs.append([run_layer(layer, h, stat_calls[b][i]) for b, h in enumerate(stat_inputs[-1])])
            del layer
    grads = _top_gradients(handle, inputs.pop(), options, device)
    sums: dict[str, list[float]] = {}  # per choice: the sequences' squared scores
    token_sums: dict[str, list[float]] = {}  # per choice: the tokens' squared scores
    for plan in reversed(plans):
        i = plan.index
        layer = handle.materialize_layer(i, torch.float32, device)
        modules = dict(layer.named_modules())
        wanted = {t.local: t.checkpoint for t in plan.targets if choices.get(t.checkpoint)}
        layer_inputs = inputs.pop()
        if len(held_out):
            stats = _input_stats(layer, modules, wanted, stat_inputs.pop(), stat_calls, i, kind)
        else:
            stats = _input_stats(layer, modules, wanted, layer_inputs, calls, i, kind)
        stored = {local: [_preview(method, modules[local].weight.data, s.weights, stats.get(local), weight_dtype)
                          for s in choices[ckpt]] for local, ckpt in wanted.items()}
        del stats
        for local, ckpt in wanted.items():
            sums.setdefault(ckpt, [0.0] * len(choices[ckpt]))
            token_sums.setdefault(ckpt, [0.0] * len(choices[ckpt]))
        below = []
        for b, h in enumerate(layer_inputs):
            seen: dict[str, list] = {}

            def hook(local):
                def fn(module, args, out):
                    dys: list = []
                    seen.setdefault(local, []).append((args[0].detach(), out.detach(), dys))
                    out.register_hook(lambda g: dys.append(g.detach()))
                return fn

            handles = [modules[local].register_forward_hook(hook(local)) for local in wanted]
            h = h.detach().requires_grad_(True)
            try:
                with torch.enable_grad():
                    out = run_layer(layer, h, calls[b][i])
                    per_draw = []
                    for d in range(options.draws):
                        (g,) = torch.autograd.grad(out, h, grad_outputs=grads[b][d], retain_graph=d < options.draws - 1,
                                                   allow_unused=True)
                        per_draw.append(torch.zeros_like(h) if g is None else g)
            finally:
                for hd in handles:
                    hd.remove()
            below.append(torch.stack(per_draw))
            del out
            with torch.no_grad():
                for local, seen_calls in seen.items():
                    ckpt, module = wanted[local], modules[local]
                    for x, y, dys in seen_calls:
                        if not dys:  # the call did not reach the output (no gradient flowed)
                            continue
                        dy = torch.stack(dys)
                        for j, scheme in enumerate(choices[ckpt]):
                            delta = F.linear(_fake_inputs(x, scheme.input_activations), stored[local][j],
                                             module.bias) - y
                            per_token = (dy * delta).sum(-1, dtype=torch.float64)  # [draws, *tokens]
                            sums[ckpt][j] += float((per_token.flatten(1).sum(1) ** 2).sum())
                            token_sums[ckpt][j] += float((per_token ** 2).sum())
        grads = below
        del layer, stored, modules
        if on_layer is not None:
            on_layer()
    scale = 0.5 / (tokens * options.draws)
    return {"sequence": {ckpt: [v * scale for v in vals] for ckpt, vals in sums.items()},
            "token": {ckpt: [v * scale for v in vals] for ckpt, vals in token_sums.items()}}
