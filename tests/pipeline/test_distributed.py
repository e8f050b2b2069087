"""Data-parallel calibration over torch.distributed (gloo, 2 processes on this CPU).

The independent expectation is a single-process run of the same command: its tensor files must be
byte-identical (same batches, statistics summed exactly in float64, solves spread and gathered). Both sides
run with one thread per process: oneDNN's bf16 matmuls round differently with 1 and 2 threads (measured), which
is a property of the thread count, not of the split.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from quantkit.distributed import Ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

ENV = {**os.environ, "QUANTKIT_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}


def _quantize_args(model: Path, method: str, out: Path, *extra: str) -> list[str]:
    return ["quantize", "--model", str(model), "--method", method, "--group-size", "32", "--num-samples", "128",
            "--seq-len", "64", "--output", str(out), "--json", *extra]


def _single(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit", *args], env=ENV, capture_output=True, text=True,
                          timeout=300)


def _torchrun(args: list[str], nproc: int = 2, env: dict | None = None, **kw):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(_free_port()), "-m", "quantkit", *args]
    return subprocess.Popen(cmd, env={**ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("family,method,extra", [
    ("llama", "gptq", []),
    ("llama", "awq", []),
    ("llama", "smoothquant+gptq", ["--scheme", "W8A8_STATIC"]),
    ("llama", "smoothquant+gptq", ["--scheme", "W8A8"]),  # SmoothQuant inside the one-pass grouped pass
    ("mixtral", "gptq", []),
])
def test_two_ranks_write_the_bytes_of_one_process(tiny_models, tmp_path, family, method, extra):
    model = tiny_models[family]
    single = _single(_quantize_args(model, method, tmp_path / "single", *extra))
    assert single.returncode == 0, single.stderr
    proc = _torchrun(_quantize_args(model, method, tmp_path / "dp", *extra))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    summary = json.loads(out)  # rank 0 alone prints: one JSON object
    assert summary["distributed"]["world_size"] == 2
    assert summary["distributed"]["batches_per_rank"] == [2, 2]
    assert summary["distributed"]["bytes_moved_per_layer"] > 0
    assert _digests(tmp_path / "dp") == _digests(tmp_path / "single")
    ref = json.loads(single.stdout)
    assert [r["rel_error"] for r in summary["layers"]] == [r["rel_error"] for r in ref["layers"]]
    if family == "mixtral":  # expert counts summed over the ranks: the single process's profile
        assert (tmp_path / "dp" / "routing_profile.json").read_bytes() == \
            (tmp_path / "single" / "routing_profile.json").read_bytes()


def test_statistics_on_the_first_batches_only_write_the_bytes_of_one_process(tiny_models, tmp_path):
    """AWQ's statistics_tokens takes the run's first batches, whichever rank holds them: here only rank 0's first
    batch, so rank 1 gathers no statistics at all and still ends with the bytes of one process."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("quantization:\n  method: awq\n  options:\n    awq:\n      statistics_tokens: 2048\n"
                      "      search_tokens: 1024\n")
    model = tiny_models["llama"]
    args = lambda out: _quantize_args(model, "awq", out, "--recipe", str(recipe))  # noqa: E731
    single = _single(args(tmp_path / "single"))
    assert single.returncode == 0, single.stderr
    full = _single(_quantize_args(model, "awq", tmp_path / "all"))
    assert full.returncode == 0, full.stderr
    proc = _torchrun(args(tmp_path / "dp"))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert json.loads(out)["distributed"]["batches_per_rank"] == [2, 2]
    assert _digests(tmp_path / "dp") == _digests(tmp_path / "single")
    assert _digests(tmp_path / "all") != _digests(tmp_path / "single")  # the subset did change the statistics


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def test_a_killed_rank_stops_the_run_and_resume_under_torchrun_finishes_it(tmp_path):
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).parents[1]))
    from conftest import make_tiny_model

    model = make_tiny_model(tmp_path / "m", "llama", num_hidden_layers=4)
    args = _quantize_args(model, "gptq", tmp_path / "dp")
    single = _single(_quantize_args(model, "gptq", tmp_path / "single"))
    assert single.returncode == 0, single.stderr

    proc = _torchrun(args, env={"QUANTKIT_DEBUG_LAYER_DELAY": "1.5"})
    journal = tmp_path / "dp.partial" / ".quantkit-journal.json"
    deadline = time.time() + 120
    while time.time() < deadline:
        if journal.exists() and json.loads(journal.read_text() or "{}").get("layers_done", 0) >= 2:
            break
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the run never committed two layers")
    workers = sorted(_children(proc.pid))
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)  # the second rank dies mid-run
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert not (tmp_path / "dp").exists()  # nothing that looks complete

    proc = _torchrun(args + ["--resume"])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert _digests(tmp_path / "dp") == _digests(tmp_path / "single")


def test_ranks_with_different_recipes_are_refused_before_any_work(tiny_models, tmp_path):
    port = _free_port()
    procs = []
    for rank, samples in ((0, "128"), (1, "64")):
        env = {**ENV, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        args = _quantize_args(tiny_models["llama"], "gptq", tmp_path / "dp")
        args[args.index("--num-samples") + 1] = samples
        procs.append(subprocess.Popen([sys.executable, "-m", "quantkit", *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    assert "rank 1's recipe, model, calibration data or quantkit version differs from rank 0's" in results[0][1]
    assert results[1][1].strip() == ""  # the other rank exits quietly: one line for the run
    assert len(results[0][1].strip().splitlines()) == 1
    assert not (tmp_path / "dp").exists() and not (tmp_path / "dp.partial").exists()


def test_shards_cover_every_batch_once_in_order():
    for world in (1, 2, 3, 5):
        for n in range(world, 40):
            shards = [Ranks(r, world).shard(n) for r in range(world)]
            assert sum(shards, []) == list(range(n))
            assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_spread_balances_units_and_is_the_same_on_every_rank():
    costs = [5.0, 1.0, 1.0, 3.0, 2.0, 2.0]
    owners = [Ranks(r, 2).spread(costs) for r in range(2)]
    assert owners[0] == owners[1]
    load = [sum(c for c, o in zip(costs, owners[0]) if o == r) for r in range(2)]
    assert load == [7.0, 7.0]


def test_float64_sums_of_float32_products_do_not_depend_on_the_split():
    # What makes the data-parallel Hessians equal one process's: the float64 total of float32 batch products
    # is the same sum in any grouping (a float32 running sum is not).
    torch.manual_seed(0)
    xtx = [(x.t() @ x) for x in (torch.randn(256, 48) * (1 + 10 * k) for k in range(8))]
    seq64 = torch.zeros(48, 48, dtype=torch.float64)
    for t in xtx:
        seq64.add_(t)
    halves = sum(xtx[:3], torch.zeros(48, 48, dtype=torch.float64)) + sum(xtx[3:], torch.zeros(48, 48, dtype=torch.float64))
    assert torch.equal(seq64.float(), halves.float())
    seq32 = torch.zeros(48, 48)
    for t in xtx:
        seq32.add_(t)
    split32 = sum(xtx[:3], torch.zeros(48, 48)) + sum(xtx[3:], torch.zeros(48, 48))
    assert not torch.equal(seq32, split32)  # the float32 version would have differed


def _node(args: list[str], node_rank: int, port: int, cwd: Path | None = None):
    """One of two torchrun "nodes" on loopback (one process each): what two machines run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
           "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "quantkit", *args]
    return subprocess.Popen(cmd, env=ENV, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_nodes_on_loopback_write_the_bytes_of_one_process(tiny_models, tmp_path):
    model = tiny_models["llama"]
    single = _single(_quantize_args(model, "gptq", tmp_path / "single"))
    assert single.returncode == 0, single.stderr
    port = _free_port()
    nodes = [_node(_quantize_args(model, "gptq", tmp_path / "dp"), r, port) for r in (0, 1)]
    results = [n.communicate(timeout=300) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [r[1][-2000:] for r in results]
    summary = json.loads(results[0][0])
    assert summary["distributed"]["world_size"] == 2 and results[1][0].strip() == ""
    assert _digests(tmp_path / "dp") == _digests(tmp_path / "single")


def test_an_output_not_every_node_sees_is_refused_in_one_line(tiny_models, tmp_path):
    """Two nodes whose `--output out` resolves to different folders (as on two machines' local disks)."""
    port = _free_port()
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for c in cwds:
        c.mkdir()
    nodes = [_node(_quantize_args(tiny_models["llama"], "gptq", Path("out")), r, port, cwd=cwds[r]) for r in (0, 1)]
    results = [n.communicate(timeout=120) for n in nodes]
    assert all(n.returncode != 0 for n in nodes)
    lines = [line for line in results[0][1].splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "not on storage every rank sees: rank 1 reads" in lines[0], results[0][1][-2000:]
    assert not any(c.joinpath("out").exists() or c.joinpath("out.partial").exists() for c in cwds)
    assert not list(cwds[0].glob(".quantkit-shared-*"))
