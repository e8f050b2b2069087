"""Every writer leaves files with the user's umask mode, as any program creating them would (safetensors' own
writer creates 0600 files, which a group serving the checkpoint cannot read)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.convert.moefy import MoEfyOptions, moefy_model

runner = CliRunner()


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o640
    os.umask(old)


def _modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


def test_every_writer_uses_the_umask(tiny_models, tmp_path, umask_027):
    model = str(tiny_models["llama"])
    runs = {
        "rtn": ["quantize", "--model", model, "--group-size", "32", "--num-samples", "2", "--seq-len", "16"],
        "fp8": ["quantize", "--model", model, "--method", "fp8", "--scheme", "FP8_DYNAMIC"],
        "mla": ["convert-mla", "--model", model, "--num-samples", "2", "--seq-len", "16", "--refine-steps", "0"],
    }
    for name, args in runs.items():
        result = runner.invoke(app, [*args, "--output", str(tmp_path / name)])
        assert result.exit_code == 0, (name, result.output)
    moefy_model(tiny_models["llama"], tmp_path / "moe", MoEfyOptions(experts=4, top_k=2), num_samples=2, seq_len=16)
    report = runner.invoke(app, ["eval", str(tmp_path / "rtn"), "--num-samples", "2", "--seq-len", "16",
                                 "--report", str(tmp_path / "report")])
    assert report.exit_code == 0, report.output
    for name in (*runs, "moe", "report"):
        modes = _modes(tmp_path / name)
        assert any(n.endswith((".safetensors", ".json")) for n in modes), name
        wrong = {n: oct(m) for n, m in modes.items() if m != umask_027}
        assert not wrong, (name, wrong)
