"""Between layers the freed heap goes back to the OS only where re-faulting it is cheap against the layer."""

from __future__ import annotations

import ctypes

import pytest
import torch

from quantkit.pipeline import memory


def _glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_trims_for_a_slow_layer_and_keeps_the_heap_for_a_fast_one():
    memory.return_large_frees_to_os()  # what a run sets first: blocks under 8 MB come from the heap
    # Fill the heap with blocks below the mmap threshold and the top's trim threshold, then free them: the free heap
    # is then at least their size, wherever glibc placed them.
    blocks = [torch.empty(1 << 20, dtype=torch.uint8).fill_(1) for _ in range(48)]
    del blocks
    free = memory._free_heap_bytes()
    assert free is not None and free >= 32 << 20
    refault = free / 4096 * memory.PAGE_FAULT_SECONDS
    assert not memory.release_freed_memory_between_layers(layer_seconds=refault / memory.TRIM_TIME_SHARE / 2)
    assert memory._free_heap_bytes() >= free // 2  # kept for the next layer
    assert memory.release_freed_memory_between_layers(layer_seconds=refault / memory.TRIM_TIME_SHARE * 2)
