"""The measured kernel choice: the fastest candidate from (injected) timings, cached per machine and signature and
retaken after a busy measurement; and end to end, the kernel that serves a model's layers is the measured fastest."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from quantkit.runtime import dispatch
from quantkit.runtime.kernels import choice
from tests.runtime.test_kernels import int_layer


class _Fake:
    def __init__(self, name):
        self.name = name


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))
    return tmp_path / "kernel-choice.json"


def test_the_fastest_injected_timing_wins_and_is_cached(cache, monkeypatch):
    layer = int_layer(32, 128, 4, True, 64, dtype=torch.bfloat16)
    cands = [(_Fake("a"), None), (_Fake("b"), None), (_Fake("c"), None)]
    times = {"a": 3e-4, "b": 1e-4, "c": 2e-4}
    calls = []

    def measure(k, p, x):
        calls.append(k.name)
        assert x.shape == (1, 128) and x.dtype == torch.bfloat16  # one decode row in the layer's dtype
        return times[k.name]

    monkeypatch.setattr(choice, "_load_per_core", lambda: 0.1)
    got = choice.choose(layer, cands, "sig", measure)
    assert got.chosen == "b" and got.microseconds == {"a": 300.0, "b": 100.0, "c": 200.0} and not got.cached
    assert json.loads(cache.read_text())  # written
    again = choice.choose(layer, cands, "sig", measure)
    assert again.chosen == "b" and again.cached and calls == ["a", "b", "c"]  # no second measurement
    times["c"] = 5e-5
    assert choice.choose(layer, cands, "other signature", measure).chosen == "c"


def test_a_timing_taken_on_a_busy_machine_is_retaken_when_quieter(cache, monkeypatch):
    layer = int_layer(32, 128, 4, True, 64, dtype=torch.bfloat16)
    cands = [(_Fake("a"), None), (_Fake("b"), None)]
    monkeypatch.setattr(choice, "_load_per_core", lambda: 3.0)
    assert choice.choose(layer, cands, "s", lambda k, p, x: {"a": 1.0, "b": 2.0}[k.name]).chosen == "a"
    monkeypatch.setattr(choice, "_load_per_core", lambda: 0.2)
    got = choice.choose(layer, cands, "s", lambda k, p, x: {"a": 2.0, "b": 1.0}[k.name])
    assert got.chosen == "b" and not got.cached


def test_a_changed_kernel_is_timed_again(cache, monkeypatch):
    """A cached timing belongs to the kernel's source: after the kernel changes (its `version`), it is measured
    again instead of losing to its own old timing (what kept a rebuilt, 1.5x faster GEMV unchosen)."""
    layer = int_layer(32, 128, 4, True, 64, dtype=torch.bfloat16)
    a, b = _Fake("a"), _Fake("b")
    a.version = "v1"
    monkeypatch.setattr(choice, "_load_per_core", lambda: 0.1)
    assert choice.choose(layer, [(a, None), (b, None)], "s", lambda k, p, x: {"a": 2.0, "b": 1.0}[k.name]).chosen == "b"
    assert choice.choose(layer, [(a, None), (b, None)], "s", lambda k, p, x: {"a": 0.5, "b": 1.0}[k.name]).cached
    a.version = "v2"
    got = choice.choose(layer, [(a, None), (b, None)], "s", lambda k, p, x: {"a": 0.5, "b": 1.0}[k.name])
    assert got.chosen == "a" and not got.cached
    from quantkit.runtime.kernels import cpp

    assert cpp.Int8DotKernel().version == cpp.DequantKernel().version == cpp.source_version() != ""


def test_a_model_is_served_by_the_measured_fastest_kernel(cache, monkeypatch):
    """W4A16 g64 bf16 layers: the C++ integer-dot GEMV, torch's int4 matmul and the dequantising kernel can all
    serve them; every layer gets the one measured fastest here, and the choice is reported."""
    monkeypatch.setenv("QUANTKIT_KERNEL_CHOICE", "measure")
    model = nn.Sequential(*[int_layer(64, 256, 4, True, 64, dtype=torch.bfloat16, seed=s) for s in range(3)])
    choices = []
    counts = dispatch.prepare_model(model, "auto", choices)
    assert len(choices) == 1  # one signature, measured once
    c = choices[0]
    assert len(c.microseconds) >= 2 and "cpu-int4dot" in c.microseconds and "cpu-dequant" in c.microseconds
    assert c.chosen == min(c.microseconds, key=c.microseconds.get)
    assert counts == {"w4a16": {c.chosen: 3}}
    monkeypatch.setenv("QUANTKIT_KERNEL_CHOICE", "priority")
    first = dispatch.prepare_model(nn.Sequential(int_layer(64, 256, 4, True, 64, dtype=torch.bfloat16)), "auto")
    assert first == {"w4a16": {"cpu-int4dot": 1}}  # the registration order
