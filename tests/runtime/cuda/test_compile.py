"""Every CUDA kernel compiles through the runtime's own NVRTC path for sm_80, sm_89 and sm_90a (no GPU or
driver needed), ptxas reports no register spills on the hot kernels, and every entry the Python side
launches exists with the argument list its launch spec passes."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings not installed (pip install 'quantkit-llm[cuda]')")

from quantkit.runtime.cuda import runtime  # noqa: E402
from quantkit.runtime.cuda.nvrtc import ARCHS, CompileError, compile_source, compile_text  # noqa: E402
from quantkit.runtime.cuda.specs import ENTRIES, SOURCES  # noqa: E402

try:  # cuda-bindings without the NVRTC wheel (or a broken one) cannot compile: say so in one line
    from quantkit.runtime.cuda.nvrtc import include_dirs, nvrtc_version

    nvrtc_version(), include_dirs()
except Exception as e:  # noqa: BLE001
    pytest.skip(f"NVRTC or the CUDA headers are not usable ({type(e).__name__}: {e})", allow_module_level=True)

PTX_KINDS = {"ptr": {"u64", "b64"}, "i64": {"u64", "s64", "b64"}, "i32": {"u32", "s32", "b32"}, "f32": {"f32"}}


@pytest.fixture(scope="module", params=[(s, a) for s in SOURCES for a in ARCHS], ids=lambda p: f"{p[0]}-{p[1]}")
def compiled(request):
    source, arch = request.param
    return compile_source(source, arch)


def ptx_entries(ptx: str) -> dict[str, list[str]]:
    """{entry name: [param type, ...]} from `.visible .entry name(.param .u64 .ptr .align 1 x, ...)`."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S):
        out[m.group(1)] = re.findall(r"\.param\s+\.(\w+)", m.group(2))
    return out


def spill_report(log: str) -> dict[str, tuple[int, int, int]]:
    """{entry: (registers, spill store bytes, spill load bytes)} from the ptxas -v log."""
    out, current, spills = {}, None, (0, 0)
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            current = m.group(1)
        elif (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)) and current:
            spills = (int(m.group(1)), int(m.group(2)))
        elif (m := re.search(r"Used (\d+) registers", line)) and current:
            out[current] = (int(m.group(1)), *spills)
            current = None
    return out


def test_entries_exist_with_the_launch_signature(compiled):
    found = ptx_entries(compiled.ptx)
    expected = [e for e in ENTRIES.values() if e.source == compiled.source]
    assert expected, f"no launch spec names {compiled.source}"
    for spec in expected:
        assert spec.name in found, f"{spec.name} missing from {compiled.source} for {compiled.arch}"
        params = found[spec.name]
        assert len(params) == len(spec.args), f"{spec.name}: PTX has {len(params)} params, spec {len(spec.args)}"
        for i, (kind, ptx_type) in enumerate(zip(spec.args, params)):
            assert ptx_type in PTX_KINDS[kind], f"{spec.name} arg {i}: spec {kind}, PTX .{ptx_type}"
    # And nothing launchable is left without a spec (an entry the Python side cannot reach is dead code).
    assert set(found) <= set(ENTRIES), f"entries without a launch spec: {set(found) - set(ENTRIES)}"


def test_no_register_spills_on_hot_kernels(compiled):
    report = spill_report(compiled.log)
    for spec in ENTRIES.values():
        if spec.source == compiled.source:
            assert spec.name in report, f"no ptxas -v report for {spec.name}"
            regs, st, ld = report[spec.name]
            if spec.hot:
                assert st == 0 and ld == 0, f"{spec.name} ({compiled.arch}): {st} B spill stores, {ld} B loads"
            assert regs <= 255


def test_fp8_paths_differ_by_arch():
    # sm_80 has no FP8 mma: its cubin must use the bf16 mma, sm_89 / sm_90a the e4m3 one.
    ptx80 = compile_source("fp8_block.cu", "sm_80").ptx
    ptx89 = compile_source("fp8_block.cu", "sm_89").ptx
    assert "e4m3.e4m3" not in ptx80 and "bf16.bf16" in ptx80
    assert "e4m3.e4m3" in ptx89


def test_compile_failure_names_kernel_and_first_error():
    bad = b'#include "qk_numerics.cuh"\nextern "C" __global__ void k(int* p) { undefined_thing(p); }\n'
    with pytest.raises(CompileError, match=r"broken\.cu \(sm_80\): .*undefined_thing"):
        compile_text("broken.cu", bad, "sm_80")


def test_launch_arguments_checked_against_spec():
    with pytest.raises(TypeError, match="takes 4 arguments"):
        runtime.pack_args("qk_tree_mask", (None, 1, 2))
    with pytest.raises(TypeError, match="expected an int"):
        runtime.pack_args("qk_tree_mask", (None, 1.5, 2, None))
    assert len(runtime.pack_args("qk_tree_mask", (None, 3, 2, None))) == 4


def test_target_arch():
    assert runtime.target_arch((9, 0)) == "sm_90a"
    assert runtime.target_arch((8, 9)) == "sm_89"
    assert runtime.target_arch((8, 0)) == "sm_80"
    assert runtime.target_arch((7, 5)) is None
