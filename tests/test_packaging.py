"""A wheel install (not editable, not the source tree) runs the default quantisation end to end.

The wheel is built from a clean copy of the working tree (no stale build/ folder can add files) and
installed into a fresh venv that has no quantkit of its own but the wheel. The dependencies (torch,
transformers, ...) come from the project's environment through a plain path entry: a `.pth` line only
appends the folder to sys.path, so the editable-install hook living there (which would point back at a
checkout) never runs, and package data missing from the wheel cannot be found anywhere else. Everything
runs from an empty temporary directory with PYTHONPATH unset, and the test checks where quantkit was
imported from. No network: pip installs the local wheel with --no-index.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "build", "dist", "runs", ".pytest_cache", "__pycache__", ".cache-ci", ".work"}


def _clean_copy(dest: Path) -> Path:
    def ignore(folder, names):
        return [n for n in names if n in SKIP_DIRS or n.endswith((".egg-info", ".pyc", ".partial"))]

    shutil.copytree(REPO, dest, symlinks=True, ignore=ignore)
    return dest


def _run(cmd, cwd, env, timeout=1800):  # generous: a shared CI machine can be 10x slower than a quiet one
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _deps_site_packages() -> list[str]:
    """The folders this (project) interpreter imports third-party packages from."""
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    return sorted({p for p in paths if Path(p).is_dir()})


@pytest.mark.slow
def test_wheel_install_runs_default_quantisation(tmp_path, smollm2_path):
    src = _clean_copy(tmp_path / "src")
    wheels = tmp_path / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                  "-q", "-w", wheels, src], cwd=tmp_path, env=os.environ.copy())
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("quantkit_llm-*.whl")

    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path, env=os.environ.copy()).returncode == 0
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["QUANTKIT_NO_PROGRESS"] = "1"
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=tmp_path, env=env).stdout.strip())
    (purelib / "project-deps.pth").write_text("\n".join(_deps_site_packages()) + "\n")
    installed = _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel],
                     cwd=tmp_path, env=env)
    assert installed.returncode == 0, installed.stderr

    work = tmp_path / "work"
    work.mkdir()
    probe = _run([py, "-c", "import json, sys, quantkit; from importlib.metadata import version; "
                  "print(json.dumps({'file': quantkit.__file__, 'version': quantkit.__version__, "
                  "'meta': version('quantkit-llm'), 'path': sys.path}))"], cwd=work, env=env)
    assert probe.returncode == 0, probe.stderr
    info = json.loads(probe.stdout)
    assert Path(info["file"]).is_relative_to(venv), info["file"]  # the wheel's copy, not a checkout
    assert not any(Path(p).resolve() == REPO for p in info["path"] if p)
    assert info["version"] == info["meta"] == wheel.name.split("-")[1]

    version = _run([venv / "bin" / "quantkit", "--version"], cwd=work, env=env)
    assert version.stdout.strip() == f"quantkit {info['version']}"
    # The recipes the README names resolve to the packaged copies where there is no recipes/ folder.
    recipe = _run([py, "-c", "from quantkit.recipe import Recipe; r = Recipe.load('recipes/gptq-w4a16.yaml'); "
                   "print(r.quantization.method, r.quantization.group_size)"], cwd=work, env=env)
    assert recipe.stdout.split() == ["gptq", "64"], recipe.stderr

    out = work / "OUT"
    run = _run([venv / "bin" / "quantkit", "quantize", "--method", "rtn", "--scheme", "W4A16", "--group-size", "64",
                "--num-samples", "2", "--seq-len", "64", "--output", out, "--json"], cwd=work, env=env)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["calibration"]["source"] == "kjv" and summary["quantized_linears"] == 210
    manifest = json.loads((out / "quantkit_manifest.json").read_text())
    assert manifest["schema_version"] == 1 and manifest["quantkit_version"] == info["version"]
    assert _run([venv / "bin" / "quantkit", "inspect", out], cwd=work, env=env).returncode == 0
    # The wheel's own runtime serves the checkpoint with the C++ CPU kernel built from the packaged csrc/
    # (not the reference fallback a missing source would give).
    kernels = _run([py, "-c", "import json; from quantkit.runtime import load_model; "
                    f"print(json.dumps(load_model({str(out)!r}).kernels))"], cwd=work, env=env)
    assert kernels.returncode == 0, kernels.stderr
    assert json.loads(kernels.stdout.strip().splitlines()[-1]) == {"w4a16": {"cpu-int4dot": 210}}, kernels.stderr

    # The checkpoint loads in transformers + compressed-tensors and runs.
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 504, 3458, 314, 260]])).logits
    assert logits.shape == (1, 5, 49152) and torch.isfinite(logits).all()
