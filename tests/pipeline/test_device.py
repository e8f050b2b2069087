"""`quantize --device`: the refusal without a GPU, the manifest's device fields, and the placement decisions of a
GPU run (where activations live, which code may see device tensors), checked without a GPU.

CUDA tensors are faked with torch's FakeTensorMode (no data, real devices: mixing a CPU and a CUDA tensor raises
FakeTensorDeviceMismatchError exactly where a GPU run would fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.errors import InputError
from quantkit.pipeline import memory
from quantkit.pipeline.activations import ActivationStore
from tests.conftest import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("device") / "llama", "llama")


def fake_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["quantize", "--model", str(model), "--method", "gptq", "--group-size", "32", "--num-samples", "4",
            "--seq-len", "32", "--output", str(out), *extra]


# ---------------------------------------------------------------- --device cuda without a GPU

@pytest.mark.parametrize("extra", [(), ("--dry-run",), ("--method", "fp8", "--scheme", "FP8_DYNAMIC")],
                         ids=["quantize", "dry-run", "data-free"])
def test_device_cuda_without_gpu_is_one_line_and_exit_2(tmp_path, tiny_llama, monkeypatch, extra):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, _args(tiny_llama, tmp_path / "out", "--device", "cuda", *extra))
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in result.output, result.output
    assert "--device cuda" in err and "no CUDA device" in err and "--device cpu" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")
def test_device_cuda_cli_process_without_gpu(tmp_path, tiny_llama):
    """The real entry point, real torch: one line on stderr, nothing on stdout, exit 2."""
    proc = subprocess.run([sys.executable, "-m", "quantkit", *_args(tiny_llama, tmp_path / "out", "--device", "cuda")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "QUANTKIT_NO_PROGRESS": "1"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda given but no CUDA device"), proc.stderr


def test_unknown_device_is_refused(tmp_path, tiny_llama):
    result = CliRunner().invoke(app, _args(tiny_llama, tmp_path / "out", "--device", "tpu"))
    assert result.exit_code == 2 and "unknown device 'tpu'" in result.stderr


# ---------------------------------------------------------------- the manifest's device fields

def test_cpu_run_records_device_and_no_device_peak(tmp_path, tiny_llama):
    result = CliRunner().invoke(app, _args(tiny_llama, tmp_path / "out", "--device", "cpu", "--json"))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    manifest = json.loads((tmp_path / "out" / "quantkit_manifest.json").read_text())
    for record in (summary, manifest):
        assert record["device"] == "cpu"
        assert record["device_name"] is None and record["device_peak_bytes"] is None  # schema: null on CPU
        assert record["activations"] == "device"
        assert record["peak_rss_bytes"] > 0
    assert "device_peak_bytes" in manifest and "device_name" in manifest  # present, not merely absent
    assert all("device_peak_bytes" not in layer for layer in manifest["layers"])  # per layer only on a GPU


def test_spilled_run_records_disk_placement(tmp_path, tiny_llama):
    result = CliRunner().invoke(app, _args(tiny_llama, tmp_path / "out", "--device", "cpu", "--json",
                                           "--offload-dir", str(tmp_path / "spill")))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["activations"] == "disk"


def test_device_peak_resets_at_start_and_per_layer(monkeypatch):
    calls, peaks = [], iter([700, 300, 900])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev: calls.append(("reset", str(dev))))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev: next(peaks))
    peak = memory.DevicePeak("cuda")
    assert calls == [("reset", "cuda")]  # the run's own peak, not the process's
    assert peak.layer() == 700 and peak.layer() == 300
    assert len(calls) == 3  # each layer starts a fresh count
    assert peak.run() == 900  # the maximum over the layers and what came after the last one
    cpu = memory.DevicePeak("cpu")
    assert cpu.layer() is None and cpu.run() is None and len(calls) == 3  # CPU: nothing asked of torch.cuda


# ---------------------------------------------------------------- placement decisions

def test_activation_placement():
    place = memory.activation_placement
    gb = 1 << 30
    assert place("cpu", 100 * gb, 0, 0) == "device"  # a CPU run has one memory
    assert place("cuda", 10 * gb, 20 * gb, 80 * gb) == "device"  # 10 <= 0.5 * (80 - 20)
    assert place("cuda", 31 * gb, 20 * gb, 80 * gb) == "host"
    assert place("cuda", 1, 90 * gb, 80 * gb) == "host"  # the layer alone does not fit: nothing else goes there
    assert place("cuda:1", 31 * gb, 20 * gb, 80 * gb, forced="device") == "device"
    assert place("cuda", 1, 0, 80 * gb, forced="host") == "host"
    assert place("cpu", 1, 0, 0, forced="host") == "device"  # forcing means nothing on CPU
    with pytest.raises(InputError, match="QUANTKIT_DEVICE_ACTIVATIONS"):
        place("cuda", 1, 0, 80 * gb, forced="disk")


def test_layer_working_bytes_counts_weights_and_hessians():
    # q [64, 64] and down [64, 128] in bf16: weights at 2 + 8 bytes, a Hessian per linear at 16 bytes per entry.
    assert memory.layer_working_bytes([(64, 64), (64, 128)], 2) == (64 * 64 + 64 * 128) * 10 + (64 * 64 + 128 * 128) * 16


def test_run_placement_asks_free_memory_only_on_cuda(monkeypatch, tiny_llama):
    from quantkit.models.loader import open_model
    from quantkit.models.source import resolve_model
    from quantkit.pipeline import engine
    from quantkit.quant.schemes import get_scheme

    handle = open_model(resolve_model(str(tiny_llama)))
    plans = engine.plan_layers(handle, get_scheme("W4A16", 32), [])
    asked = []
    monkeypatch.setattr(engine, "_free_memory", lambda dev: asked.append(dev) or free)
    assert engine.run_activation_placement(handle, plans, "cpu", torch.float32, 10**9) == "device" and not asked
    # hidden 64, bf16: a generation of 1M tokens is 128 MiB; the largest layer's working set is a few MB.
    free = 1 << 30
    assert engine.run_activation_placement(handle, plans, "cuda", torch.bfloat16, 1 << 20) == "device"
    free = 200 << 20
    assert engine.run_activation_placement(handle, plans, "cuda", torch.bfloat16, 1 << 20) == "host"
    assert [d.type for d in asked] == ["cuda", "cuda"]
    monkeypatch.setenv("QUANTKIT_DEVICE_ACTIVATIONS", "device")
    assert engine.run_activation_placement(handle, plans, "cuda", torch.bfloat16, 1 << 20) == "device"


def test_activation_store_on_host_hands_batches_back_on_the_device():
    with fake_cuda():  # cuda:0: a fake tensor cannot be moved to an index-less "cuda" on a CPU build
        store = ActivationStore(device="cuda:0", host=True)
        store[0] = torch.randn(2, 3, 8, device="cuda")
        assert store.placement == "host"
        assert store._mem[0].device.type == "cpu"  # kept in host memory
        assert store[0].device.type == "cuda" and store[0].shape == (2, 3, 8)  # read back where the layer is
        kept = ActivationStore(device="cuda:0")
        kept[0] = torch.randn(2, 3, 8, device="cuda")
        assert kept.placement == "device" and kept._mem[0].device.type == "cuda"
    assert ActivationStore(device="cpu", host=True).placement == "device"  # no host/device split on CPU


def test_spilled_and_resumed_batches_come_back_on_the_store_device(tmp_path):
    h = torch.randn(2, 3, 8)
    spill = ActivationStore(tmp_path / "spill", device="meta")  # meta: any device that is not the CPU
    spill[0] = h
    assert spill.placement == "disk" and spill[0].device.type == "meta"
    plain = ActivationStore()
    plain[0] = h
    plain.save_to(tmp_path / "gen", [0])
    resumed = ActivationStore.load_from(tmp_path / "gen", [0], None, device="meta")
    assert resumed[0].device.type == "meta"  # a resumed GPU run gets its activations on the GPU
    on_host = ActivationStore.load_from(tmp_path / "gen", [0], None, device="meta", host=True)
    assert on_host._mem[0].device.type == "cpu" and torch.equal(on_host._mem[0], h)


# ---------------------------------------------------------------- which code may see CUDA tensors

def test_gptq_compiled_column_loop_only_for_cpu(monkeypatch):
    from quantkit.methods import gptq

    sentinel = object()
    monkeypatch.setattr(gptq, "gptq_extension", lambda: sentinel)
    assert gptq.column_loop_extension(torch.device("cpu")) is sentinel
    monkeypatch.setattr(gptq, "gptq_extension", lambda: pytest.fail("the C++ loop was offered a CUDA solve"))
    assert gptq.column_loop_extension(torch.device("cuda")) is None
    assert gptq.column_loop_extension("cuda:1") is None


def test_fused_scale_search_is_not_offered_cuda_tensors(monkeypatch):
    from quantkit.quant import integer
    from quantkit.quant.args import QuantArgs

    monkeypatch.setattr(integer, "search_extension", lambda: pytest.fail("the C++ search was offered CUDA tensors"))
    args = QuantArgs(num_bits=4, strategy="group", group_size=32)
    with fake_cuda():
        w = torch.randn(16, 32, device="cuda")
        assert integer._fused_search(w, args, torch.bfloat16, 20, 0.2, None) is None
    monkeypatch.setattr(integer, "group_qparams_eager", lambda w, *a, **k: ("eager", w.device.type))
    with fake_cuda():
        assert integer.group_qparams(torch.randn(16, 32, device="cuda"), args, torch.bfloat16, mse=True) == ("eager", "cuda")


def test_gptq_output_error_sums_stay_on_the_weights_device():
    """Was: the error report's sums were a CPU tensor, so every GPU GPTQ run failed at its first linear. (meta
    stands in for CUDA: a CPU tensor silently absorbs meta ones, so the sums' device is what tells.)"""
    from quantkit.methods.gptq import output_error_quads

    w, h = torch.randn(8, 16, device="meta"), torch.randn(16, 16, device="meta")
    quads = output_error_quads(w, [w * 0.9, w * 1.1], h, torch.arange(16, device="meta"), rows=3)
    assert quads.device.type == "meta" and quads.shape == (3,)


def test_routing_counts_of_a_gpu_layer():
    """Was: the routing profile's one-hot matrix was made on the CPU and scattered with CUDA ids (MoE on a GPU)."""
    from quantkit.models.routing_profile import LayerCounts, count_selection

    counts, co = count_selection(torch.randint(0, 4, (5, 2), device="meta"), 4)  # meta stands in for CUDA
    assert counts.device.type == "meta" and co.shape == (4, 4)  # computed where the routing was
    layer = LayerCounts(4)
    layer.add(torch.tensor([[0, 1], [1, 3]]))
    assert layer.counts.device.type == "cpu" and layer.counts.tolist() == [1, 2, 0, 1]
    real = torch.tensor([[0, 1], [1, 3], [7, 1]])  # 7: a dropped slot
    counts, co = count_selection(real, 4)
    assert counts.tolist() == [1, 3, 0, 1] and co[1, 3] == 1


def test_phase_timings_wait_for_the_gpu(monkeypatch):
    """A GPU run's phases are charged their own queued kernels: the device is synchronised at both ends."""
    from quantkit.methods.base import LayerContext

    ctx = LayerContext(index=0, layer=torch.nn.Identity(), targets={}, scheme=None, checkpoint_names={})
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(1))
    with ctx.phase("solve"):
        pass
    assert synced == []  # CUDA never initialised: a CPU run asks nothing of it
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with ctx.phase("solve"):
        assert synced == [1]
    assert synced == [1, 1] and ctx.phases["solve"] >= 0
