"""The one-pass schedule: group order learned by a probe, batches paused at each group until its statistics are
complete, and the result of a plain sequential computation written out in the test."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.pipeline.grouped import GroupedPass, probe_groups

runner = CliRunner()


class Chain(nn.Module):
    """x -> (a, b read x) -> c reads a(x) + b(x) -> d reads c(...)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8, bias=False) for _ in range(4))
        for lin in (self.a, self.b, self.c, self.d):
            lin.weight.data = torch.randn(8, 8, generator=g)

    def forward(self, x):
        return self.d(torch.relu(self.c(self.a(x) + self.b(x))))


def _targets(m: Chain) -> dict[str, nn.Linear]:
    return {"a": m.a, "b": m.b, "c": m.c, "d": m.d}


def _quantise(lin: nn.Linear, sq: torch.Tensor) -> None:
    """A stand-in for a method: scale each input column by its statistics, round, scale back."""
    s = sq.sqrt().clamp_min(1e-6)
    lin.weight.data = torch.round(lin.weight.data * s * 4) / (s * 4)


def test_probe_finds_groups_in_call_order():
    m = Chain()
    out, groups = probe_groups(_targets(m), lambda: m(torch.randn(3, 8)))
    assert groups == [["a", "b"], ["c"], ["d"]] and out.shape == (3, 8)
    # A target the forward never calls: no static order.
    extra = {**_targets(m), "e": nn.Linear(8, 8)}
    assert probe_groups(extra, lambda: m(torch.randn(3, 8)))[1] is None


def test_grouped_pass_equals_the_sequential_computation():
    xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(j)) for j in range(4)]
    # Expected, written out: each group's statistics over all batches with the earlier groups already quantised.
    ref = Chain()
    sq = sum(x.pow(2).sum(0) for x in xs)
    _quantise(ref.a, sq), _quantise(ref.b, sq)
    h = [ref.a(x) + ref.b(x) for x in xs]
    _quantise(ref.c, sum(v.pow(2).sum(0) for v in h))
    h = [torch.relu(ref.c(v)) for v in h]
    _quantise(ref.d, sum(v.pow(2).sum(0) for v in h))
    expected = [ref.d(v) for v in h]

    m = Chain()
    targets = _targets(m)
    stats: dict[str, torch.Tensor] = {}
    order: list[tuple] = []
    applied: set[str] = set()

    def record(name):
        def hook(mod, args):
            if name not in applied:
                stats[name] = stats.get(name, 0) + args[0].pow(2).sum(0)
                order.append(("stat", name))
        return hook

    groups = [["a", "b"], ["c"], ["d"]]

    def apply_group(names):
        order.append(("apply", tuple(names)))
        for n in names:
            _quantise(targets[n], stats[groups[0][0]] if n in groups[0] else stats[n])
            applied.add(n)

    grouped = GroupedPass(groups, apply_group)
    hooks = [lin.register_forward_pre_hook(record(n)) for n, lin in targets.items()]
    hooks += [targets[g[0]].register_forward_pre_hook(grouped.gate(i)) for i, g in enumerate(groups)]
    with torch.no_grad():
        got = grouped.run(list(range(4)), lambda j: m(xs[j]))
    for h in hooks:
        h.remove()
    for j in range(4):
        assert torch.allclose(got[j], expected[j], atol=1e-5)
    # Each group applied once, after every batch's statistics for it, in group order.
    applies = [i for i, o in enumerate(order) if o[0] == "apply"]
    assert [order[i][1] for i in applies] == [("a", "b"), ("c",), ("d",)]
    assert [o for o in order[: applies[0]] if o == ("stat", "a")] == [("stat", "a")] * 4


def test_a_failing_batch_stops_the_pass_with_its_error():
    m = Chain()
    targets = _targets(m)
    grouped = GroupedPass([["a", "b"], ["c"], ["d"]], lambda names: None)
    hooks = [targets[g].register_forward_pre_hook(grouped.gate(i)) for i, g in enumerate(["a", "c", "d"])]

    def forward(j):
        if j == 2:
            raise ValueError("batch 2 is broken")
        return m(torch.randn(2, 8))

    with pytest.raises(ValueError, match="batch 2 is broken"):
        grouped.run(list(range(4)), forward)
    for h in hooks:
        h.remove()


def test_batches_run_on_the_calling_thread_and_a_failure_unwinds_the_paused_ones():
    """One thread for every batch (one OpenMP pool: see the module docstring), the caller's grad mode inside each
    batch, and after a failing batch the paused ones unwind (their finally blocks run) before the error is raised;
    the next pass is unaffected."""
    import threading

    xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(j)) for j in range(4)]

    def one_pass(fail_at=None, seen=None, unwound=None):
        m = Chain()
        targets = _targets(m)
        grouped = GroupedPass([["a", "b"], ["c"], ["d"]], lambda names: None)
        hooks = [targets[g].register_forward_pre_hook(grouped.gate(i)) for i, g in enumerate(["a", "c", "d"])]

        def forward(j):
            if seen is not None:
                seen.append((threading.get_ident(), torch.is_grad_enabled()))
            try:
                if j == fail_at:
                    m.a(xs[j])  # pauses at the first group like the others, then fails after it resumes
                    raise ValueError(f"batch {j} is broken")
                return m(xs[j])
            finally:
                if unwound is not None:
                    unwound.append(j)

        try:
            with torch.no_grad():
                return grouped.run(list(range(4)), forward)
        finally:
            for h in hooks:
                h.remove()

    seen: list = []
    first = one_pass(seen=seen)
    assert seen == [(threading.get_ident(), False)] * 4
    unwound: list = []
    with pytest.raises(ValueError, match="batch 1 is broken"):
        one_pass(fail_at=1, unwound=unwound)
    assert sorted(unwound) == [0, 1, 2, 3]  # batch 1 failed; 0, 2 and 3 were paused and unwound
    again = one_pass()
    for j in range(4):
        assert torch.equal(first[j], again[j])


def test_forwards_run_by_apply_group_pass_the_gates():
    """A method's apply may run the block itself (a loss over candidate scales): its forward must not pause."""
    m = Chain()
    targets = _targets(m)
    calls = []

    def apply_group(names):
        calls.append(tuple(names))
        m(torch.randn(2, 8))  # through every gate, on the scheduler's stack

    grouped = GroupedPass([["a", "b"], ["c"], ["d"]], apply_group)
    hooks = [targets[g].register_forward_pre_hook(grouped.gate(i)) for i, g in enumerate(["a", "c", "d"])]
    with torch.no_grad():
        out = grouped.run([0, 1], lambda j: m(torch.randn(3, 8)))
    for h in hooks:
        h.remove()
    assert calls == [("a", "b"), ("c",), ("d",)] and sorted(out) == [0, 1]


def test_one_pass_first_group_equals_two_pass(tmp_path, tiny_models, text_file):
    """The first group (q/k/v of layer 0) sees the same unquantised inputs in both schedules: identical tensors.
    Later groups see the earlier groups quantised in one-pass, so they may differ."""
    outs = {}
    for schedule in ("one-pass", "two-pass"):
        out = tmp_path / schedule
        res = runner.invoke(app, ["quantize", "--model", str(tiny_models["llama"]), "--method", "gptq",
                                  "--group-size", "32", "--dataset", str(text_file), "--num-samples", "16",
                                  "--seq-len", "64", "--schedule", schedule, "--output", str(out), "--json"])
        assert res.exit_code == 0, res.output
        outs[schedule] = load_file(str(out / "model.safetensors"))
        assert json.loads(res.stdout)["phase_seconds"]["forward"] > 0
    one, two = outs["one-pass"], outs["two-pass"]
    first = [k for k in one if k.startswith("model.layers.0.self_attn.") and k.split(".")[4] in ("q_proj", "k_proj",
                                                                                              "v_proj")]
    assert len(first) >= 6 and all(torch.equal(one[k], two[k]) for k in first)
    assert any(not torch.equal(one[k], two[k]) for k in one if ".layers.1." in k)


def test_bad_schedule_is_one_line(tiny_models, tmp_path):
    res = runner.invoke(app, ["quantize", "--model", str(tiny_models["llama"]), "--method", "gptq",
                              "--schedule", "three-pass", "--output", str(tmp_path / "x")])
    assert res.exit_code == 2 and "calibration.schedule must be auto or one-pass or two-pass" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_no_static_order_falls_back_to_two_pass_unchanged(tmp_path, tiny_models, text_file, monkeypatch):
    """When the probe finds no static group order the layer runs two-pass, untouched by the attempt: with a
    transform stage first (SmoothQuant) its smoothing must be applied once, so the bytes equal a two-pass run's."""
    import quantkit.pipeline.grouped as grouped

    def run(schedule, out):
        res = runner.invoke(app, ["quantize", "--model", str(tiny_models["llama"]), "--method", "smoothquant+gptq",
                                  "--scheme", "W8A8", "--group-size", "-1", "--dataset", str(text_file),
                                  "--num-samples", "8", "--seq-len", "64", "--schedule", schedule,
                                  "--output", str(out), "--json"])
        assert res.exit_code == 0, res.output
        return load_file(str(out / "model.safetensors"))

    two = run("two-pass", tmp_path / "two")
    real_probe = grouped.probe_groups
    monkeypatch.setattr(grouped, "probe_groups", lambda targets, forward, inputs=None: (real_probe(targets, forward)[0], None))
    fallback = run("one-pass", tmp_path / "fallback")
    assert two.keys() == fallback.keys() and all(torch.equal(two[k], fallback[k]) for k in two)


def test_smoothquant_joins_the_grouped_pass(tiny_models):
    """SmoothQuant+GPTQ under one-pass: the smoothing runs inside the grouped pass (each batch goes through the layer
    once there, not once more for SmoothQuant's own statistics), and the first group comes out as in a two-pass run,
    whose GPTQ sees the smoothed input itself: the same folded norm, GPTQ's Hessian rescaled to the same one, and the
    paused inputs divided by the scales (a layer output as accurate as the separate-pass schedule's)."""
    import copy

    from quantkit.methods.gptq import GPTQ
    from quantkit.methods.smoothquant import SmoothQuant
    from quantkit.models.loader import open_model
    from quantkit.models.source import resolve_model
    from quantkit.pipeline.activations import ActivationStore
    from quantkit.pipeline.capture import capture_layer_inputs, run_layer
    from quantkit.pipeline.engine import LayerBatches, layer_context, plan_layers, process_layer
    from quantkit.quant.schemes import get_scheme

    handle = open_model(resolve_model(str(tiny_models["llama"])))
    scheme = get_scheme("W8A8")
    plan = plan_layers(handle, scheme, ["lm_head"])[0]
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    hidden, calls = capture_layer_inputs(handle, ids, 2, "cpu", torch.float32)
    base = handle.materialize_layer(0, torch.float32)
    with torch.no_grad():
        reference = [run_layer(base, hidden[j], calls[j][0]) for j in range(4)]

    def run(schedule, fuse=True, monkeypatch=None):
        layer = copy.deepcopy(base)
        ctx = layer_context(handle, plan, layer, scheme, torch.float32, torch.float32, False)
        acts = ActivationStore(None)
        for j in range(4):
            acts[j] = hidden[j].clone()
        batches = LayerBatches.local(acts, calls[:4], error_batches=1)
        sq = SmoothQuant(scheme)
        if not fuse:
            sq.group_sources = lambda ctx: None
        forwards = []
        counter = layer.register_forward_pre_hook(lambda *a: forwards.append(1))
        process_layer(layer, ctx, [sq, GPTQ(scheme)], batches, schedule=schedule)
        counter.remove()
        assert ctx.schedule == schedule
        error = sum((acts[j] - reference[j]).pow(2).sum() for j in range(4)) / sum(r.pow(2).sum() for r in reference)
        return layer, len(forwards), float(error)

    fused, n_fused, err_fused = run("one-pass")
    separate, n_separate, err_separate = run("one-pass", fuse=False)
    two, _, _ = run("two-pass")
    assert n_fused == 1 + 4 and n_separate == 1 + 4 + 4  # the probe (batch 0's reference), then the batches
    norm = "input_layernorm.weight"
    assert not torch.equal(fused.get_parameter(norm), base.get_parameter(norm))
    assert torch.equal(fused.get_parameter(norm), two.get_parameter(norm))
    for name in ("q_proj", "k_proj", "v_proj"):
        w1, w2 = (m.get_submodule(f"self_attn.{name}").weight for m in (fused, two))
        step = w2.abs().amax(dim=1, keepdim=True) / 127  # the int8 grid of each row
        assert ((w1 - w2).abs() <= 0.51 * step).all() and (w1 == w2).float().mean() > 0.99, name
    assert 0 < err_fused < 1.5 * err_separate
