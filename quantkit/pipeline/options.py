"""Options a user set that the chosen method or scheme will not use: each gets one warning line, so a run that
ignores `--group-size 64` (per-channel W8A8) or `--num-samples` (data-free FP8) says so instead of passing
silently."""

from __future__ import annotations

from quantkit.recipe import Recipe

_STRATEGY_WORDS = {"channel": "per output channel", "tensor": "one per tensor", "block": "per 128x128 block"}


def ineffective_options(rec: Recipe, given: dict[str, object]) -> list[str]:
    """`given`: the options the user set (flag name -> value). Returns one message per option without effect."""
    from quantkit.methods import build_methods
    from quantkit.pipeline.stream import streams
    from quantkit.quant.schemes import get_scheme

    q = rec.quantization
    scheme = get_scheme(q.scheme, q.group_size)
    methods = build_methods(q.method, scheme, q.options)
    names = [m.name for m in methods]
    out = []
    if given.get("--group-size") is not None and scheme.format != "pack-quantized":
        out.append(f"--group-size {given['--group-size']} has no effect with {scheme.name}: its weight scales are "
                   f"{_STRATEGY_WORDS.get(scheme.weights.strategy, scheme.weights.strategy)}")
    data_flags = [f for f in ("--dataset", "--num-samples", "--seq-len", "--text-column") if given.get(f) is not None]
    if streams(methods, scheme, q.kv_cache):
        out += [f"{f} has no effect: {q.method} with {scheme.name} is data-free (no calibration pass)" for f in data_flags]
    elif not (any(m.needs_calibration for m in methods) or scheme.static_activations or q.kv_cache) \
            and given.get("--num-samples") is not None and int(given["--num-samples"]) > rec.calibration.error_samples:
        # the engine draws min(num_samples, error_samples) samples for such a run (pipeline/engine.py)
        out.append(f"--num-samples {given['--num-samples']} has no effect with {q.method}: it needs no calibration "
                   f"set and runs only calibration.error_samples ({rec.calibration.error_samples}) samples, to measure "
                   f"each layer's error and weigh its scale search")
    for flag, method in (("--actorder", "gptq"), ("--dampening", "gptq"), ("--alpha", "smoothquant")):
        if given.get(flag) is not None and method not in names:
            out.append(f"{flag} has no effect: it is a {method} option and the method is {q.method}")
    return out
