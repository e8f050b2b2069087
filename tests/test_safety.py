"""Release safety: one writer per output, missing optional packages named with their extra, the manifest's
schema version, the version string, and resume state that stays bounded on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import app

runner = CliRunner()
ENV = {**os.environ, "QUANTKIT_NO_PROGRESS": "1"}


def _one_line_error(result, code, *needles):
    assert result.exit_code == code, (result.exit_code, result.output)
    err = result.stderr.strip()
    assert "Traceback" not in result.output and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def _quantize_args(src: Path, out: Path) -> list[str]:
    return ["quantize", "--model", str(src), "--method", "rtn", "--group-size", "32", "--num-samples", "4",
            "--seq-len", "32", "--output", str(out)]


def _wait_for(predicate, timeout=180.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _journal(partial: Path) -> dict:
    try:
        return json.loads((partial / ".quantkit-journal.json").read_text() or "{}")
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_second_run_on_the_same_output_is_refused_with_the_first_ones_pid(tmp_path):
    from tests.conftest import make_tiny_model

    src = make_tiny_model(tmp_path / "src", "llama", num_hidden_layers=6)
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-m", "quantkit.cli", *_quantize_args(src, out)],
                             env={**ENV, "QUANTKIT_DEBUG_LAYER_DELAY": "0.5"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: _journal(tmp_path / "out.partial").get("layers_done", 0) >= 1)
        # --overwrite would delete the first run's partial folder if the second one got that far.
        second = subprocess.run([sys.executable, "-m", "quantkit.cli", *_quantize_args(src, out), "--overwrite"],
                                env=ENV, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip().splitlines() == [
            f"error: another quantkit run (pid {first.pid}) is writing {out}"]
        assert first.wait(timeout=300) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            first.kill()
    assert (out / "model.safetensors").is_file() and not (tmp_path / "out.partial").exists()
    assert not (tmp_path / "out.partial.lock").exists()
    # The lock went with the first run: the next one starts normally.
    again = subprocess.run([sys.executable, "-m", "quantkit.cli", *_quantize_args(src, out), "--overwrite"],
                           env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr


def test_lock_of_a_killed_run_does_not_block_the_next(tmp_path):
    """flock dies with its process: a SIGKILLed holder leaves the file but no lock."""
    from quantkit.pipeline.lock import lock_path, output_lock

    out = tmp_path / "o"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from quantkit.pipeline.lock import output_lock\n"
                               f"with output_lock(Path({str(out)!r})):\n print('held', flush=True); time.sleep(60)"],
                              env={**ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    from quantkit.errors import InputError

    with pytest.raises(InputError, match=f"another quantkit run \\(pid {holder.pid}\\) is writing"):
        with output_lock(out):
            pass
    holder.kill()
    holder.wait()
    assert lock_path(out).exists()  # SIGKILL ran no cleanup ...
    with output_lock(out):  # ... and yet the lock is free
        assert lock_path(out).read_text().strip() == str(os.getpid())
    assert not lock_path(out).exists()


@pytest.mark.parametrize("module,args,needle", [
    ("matplotlib", ["--report", "REPORT"], "eval --report needs matplotlib, which is not installed: "
                                           "pip install 'quantkit-llm[eval]'"),
    ("lm_eval", ["--lm-eval", "hellaswag"], "eval --lm-eval needs lm-eval, which is not installed: "
                                            "pip install 'quantkit-llm[lm-eval]'"),
])
def test_missing_optional_package_is_named_with_its_extra(tmp_path, monkeypatch, module, args, needle):
    # None in sys.modules makes `import module` raise ModuleNotFoundError, exactly as if it were not installed.
    monkeypatch.setitem(sys.modules, module, None)
    args = [str(tmp_path / "r") if a == "REPORT" else a for a in args]
    result = runner.invoke(app, ["eval", str(tmp_path), *args])
    _one_line_error(result, 2, needle)
    assert not (tmp_path / "r").exists()


def test_missing_matplotlib_inside_report_writing(tmp_path, monkeypatch):
    """The report writer itself (used by release as well) raises the same one-line error."""
    from quantkit.eval.report import write_plots
    from quantkit.optional import MissingDependency

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependency, match=r"quantkit-llm\[eval\]"):
        write_plots(tmp_path, {"results": [], "baseline": {}}, {})


def test_a_broken_optional_package_is_not_reported_as_missing(monkeypatch):
    """An ImportError from inside an installed package (its own dependency broken) keeps its real cause."""
    import importlib

    from quantkit.optional import require

    def fake_import(name, *a, **k):
        raise ModuleNotFoundError("No module named 'kiwisolver'", name="kiwisolver")

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(ModuleNotFoundError, match="kiwisolver"):
        require("matplotlib", "eval --report")


def test_manifest_schema_version_written_and_checked(tmp_path, tiny_models):
    out = tmp_path / "out"
    assert runner.invoke(app, _quantize_args(tiny_models["llama"], out)).exit_code == 0
    path = out / "quantkit_manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest["schema_version"] == 1
    assert runner.invoke(app, ["inspect", str(out)]).exit_code == 0
    path.write_text(json.dumps({**manifest, "schema_version": 2}))
    _one_line_error(runner.invoke(app, ["inspect", str(out)]), 2, "schema_version 2", "upgrade quantkit")
    # eval reads the manifest for its default baseline and the hashes: the same refusal, before any work.
    _one_line_error(runner.invoke(app, ["eval", str(out)]), 2, "schema_version 2")
    legacy = {k: v for k, v in manifest.items() if k != "schema_version"}  # written before the field existed
    path.write_text(json.dumps(legacy))
    assert runner.invoke(app, ["inspect", str(out)]).exit_code == 0


def test_version_is_the_package_version():
    import re

    import quantkit

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert quantkit.__version__ == re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"quantkit {quantkit.__version__}"


def test_state_policy_bounds_the_time_spent_saving():
    from quantkit.pipeline.journal import StatePolicy

    now = [0.0]
    policy = StatePolicy(ratio=10, clock=lambda: now[0])
    saves, layer_seconds, save_seconds = 0, 1.0, 2.0
    for _ in range(200):
        now[0] += layer_seconds
        if policy.due():
            began = now[0]
            now[0] += save_seconds
            policy.saved(began)
            saves += 1
    # A 2 s save after 1 s layers: the first layer saves, then one save per >= 20 s of layer work.
    assert saves == 1 + (200 - 1) // 20
    total = 200 * layer_seconds + saves * save_seconds
    assert saves * save_seconds / total <= 1 / 11 + 1e-9


def test_resume_from_an_older_saved_state_recomputes_the_gap(tmp_path):
    """With state saved only after layer 0 (a huge ratio), a kill after layer 3 resumes at layer 1 and still
    writes the uninterrupted run's bytes; only one generation is ever on disk."""
    from tests.conftest import make_tiny_model

    src = make_tiny_model(tmp_path / "src", "llama", num_hidden_layers=6)
    clean, out = tmp_path / "clean", tmp_path / "killed"
    base = [sys.executable, "-m", "quantkit.cli"]
    assert subprocess.run(base + _quantize_args(src, clean), env=ENV, capture_output=True).returncode == 0
    partial = tmp_path / "killed.partial"
    generations: set[tuple[str, ...]] = set()
    proc = subprocess.Popen(base + _quantize_args(src, out),
                            env={**ENV, "QUANTKIT_DEBUG_LAYER_DELAY": "0.4", "QUANTKIT_RESUME_STATE_RATIO": "1e9"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def progressed():
        if (partial / ".state").is_dir():
            generations.add(tuple(sorted(p.name for p in (partial / ".state").iterdir())))
        return _journal(partial).get("layers_done", 0) >= 4

    assert _wait_for(progressed)
    proc.kill()
    proc.wait()
    journal = _journal(partial)
    assert journal["state_layer"] == 1 and journal["layers_done"] >= 4
    assert all(len(g) <= 1 for g in generations), generations
    resumed = subprocess.run(base + _quantize_args(src, out) + ["--resume", "--json"], env=ENV,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert [r["layer"] for r in summary["layers"]] == list(range(6))
    assert (out / "model.safetensors").read_bytes() == (clean / "model.safetensors").read_bytes()


def test_spilled_state_is_hard_linked_not_written(tmp_path, tiny_models):
    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe

    r = Recipe()
    r.model.source = str(tiny_models["llama"])
    r.quantization.group_size = 32
    r.calibration.num_samples, r.calibration.seq_len = 4, 32
    in_memory = quantize_model(r, tmp_path / "mem")
    spilled = quantize_model(r, tmp_path / "spill", offload_dir=tmp_path / "acts")
    # 2 layers: the state entering layer 1 is saved once; in memory it is written, spilled it is linked.
    # samples x tokens x hidden x the compute dtype's size (activations are kept in it: bf16 under autocast)
    element = 2 if in_memory["compute_dtype"].startswith(("bfloat16", "float16")) else 4
    one_generation = 4 * 32 * 64 * element
    assert one_generation <= in_memory["resume_state_bytes"] < 2 * one_generation
    assert spilled["resume_state_bytes"] == 0
    assert (tmp_path / "mem" / "model.safetensors").read_bytes() == (tmp_path / "spill" / "model.safetensors").read_bytes()
