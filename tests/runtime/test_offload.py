"""Expert offloading (quantkit/runtime/offload.py): exact logits, residency bounds, policies, prefetch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quantkit.errors import InputError
from quantkit.eval.moe import greedy_decode
from quantkit.models.routing_profile import RoutingProfile
from quantkit.runtime import load_model
from quantkit.runtime.offload import OffloadOptions, install_offload

PROMPT = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def quantised(tiny_models, tmp_path_factory):
    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe

    out = tmp_path_factory.mktemp("offq") / "q"
    r = Recipe()
    r.model.source = str(tiny_models["qwen2_moe"])
    r.quantization.method, r.quantization.scheme, r.quantization.group_size = "rtn", "W4A16", 32
    r.calibration.num_samples, r.calibration.seq_len = 2, 16
    quantize_model(r, out, compute_dtype="float32")
    return out


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "mixtral", "quantised"])
@pytest.mark.parametrize("policy,prefetch,overlap", [("lru", False, True), ("lfu", False, True), ("trace", True, True),
                                                     ("lru", True, False)])
def test_offloaded_decode_has_exactly_the_resident_logits(tiny_models, quantised, family, policy, prefetch, overlap):
    path = quantised if family == "quantised" else tiny_models[family]
    ref, _ = greedy_decode(load_model(path), PROMPT, 12)
    rt = load_model(path)
    cache = install_offload(rt, OffloadOptions(2, policy, prefetch, overlap=overlap))
    got, _ = greedy_decode(rt, PROMPT, 12)
    assert torch.equal(got, ref)
    assert cache.stats.requests > 0 and cache.stats.loads > 0 and cache.stats.bytes_moved > 0
    for layer in cache.resident:
        assert len(cache.resident[layer]) <= 2  # never more than N resident


def test_non_resident_experts_hold_no_tensors(tiny_models):
    rt = load_model(tiny_models["qwen2_moe"])
    before = sum(p.numel() for p in rt.model.parameters() if p.device.type != "meta")
    cache = install_offload(rt, OffloadOptions(2, "lru"))
    after = sum(p.numel() for p in rt.model.parameters() if p.device.type != "meta")
    per_expert = sum(p.numel() for p in next(iter(cache.templates.values())).parameters())
    assert before - after == sum(1 for _ in cache.templates) * per_expert > 0


def test_cache_size_outside_k_to_e_is_refused_with_the_range(tiny_models):
    rt = load_model(tiny_models["qwen2_moe"])  # 4 experts, top-2
    for n in (1, 5):
        with pytest.raises(InputError, match=r"valid range 2\.\.4"):
            install_offload(rt, OffloadOptions(n, "lru"))


def _requests(cache, layer, experts):
    for e in experts:
        cache.fetch(layer, e)


def test_policies_evict_as_defined(tiny_models):
    def fresh(policy, profile=None):
        rt = load_model(tiny_models["mixtral"])
        return install_offload(rt, OffloadOptions(2, policy), profile)

    lru = fresh("lru")
    _requests(lru, 0, [0, 0, 0, 1, 2])  # 0 is frequent but least recent
    assert sorted(lru.resident_experts(0)) == [1, 2]
    lfu = fresh("lfu")
    _requests(lfu, 0, [0, 0, 0, 1, 2])
    assert sorted(lfu.resident_experts(0)) == [0, 2]
    # Trace: the profile says expert 3 is hot; it is resident from the start and survives a cold request.
    prof = RoutingProfile(4, 2)
    for layer in (0, 1):
        prof.add(layer, torch.tensor([[3, 1]] * 50 + [[3, 2]] * 20))
    trace = fresh("trace", prof)
    assert sorted(trace.resident_experts(0)) == [1, 3]
    _requests(trace, 0, [0])
    assert 3 in trace.resident_experts(0) and trace.stats.hits == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_draft_prefetch_predicts_and_raises_the_hit_rate(tiny_models, overlap, monkeypatch):
    import threading

    from quantkit.runtime import offload

    path = tiny_models["qwen3_moe"]
    rates, threads = {}, set()
    reads = offload._pread_all

    def spy(jobs, cold=False):
        threads.add(threading.current_thread().name.split("_")[0])
        return reads(jobs, cold)

    monkeypatch.setattr(offload, "_pread_all", spy)
    for prefetch in (False, True):
        rt = load_model(path)
        cache = install_offload(rt, OffloadOptions(2, "lru", prefetch, overlap=overlap))
        fetch, held = cache.fetch, []

        def counted(layer, expert, fetch=fetch, cache=cache):
            out = fetch(layer, expert)
            held.append(len(cache.resident[layer]) + len(cache.pending[layer]))
            return out

        cache.fetch = counted
        greedy_decode(rt, PROMPT, 24, on_prefill=cache.reset_stats)
        # Experts being read count against the cache: never more modules with tensors than its size.
        assert held and max(held) <= 2
        rates[prefetch] = cache.stats.to_dict()
        cache.remove()
    assert rates[True]["prefetch_fidelity"] is not None and rates[True]["prefetch_fidelity"] > 2 / 4
    assert rates[True]["prefetch_loads"] > 0
    assert rates[True]["hit_rate"] > rates[False]["hit_rate"]
    # Overlapped prefetch reads experts on its own thread; synchronous prefetch never leaves the caller's.
    assert ("quantkit-prefetch" in threads) == overlap


@pytest.mark.skipif(not hasattr(__import__("os"), "posix_fadvise"), reason="posix_fadvise is Linux's")
@pytest.mark.parametrize("prefetch", [False, True])
def test_storage_reads_drop_every_range_they_read_from_the_page_cache(quantised, prefetch, monkeypatch):
    """reads="storage": the checkpoint is dropped from the page cache when offloading starts, and every byte range a
    load reads is dropped after it (so its next read comes from storage); the logits stay the resident model's."""
    import os

    from quantkit.runtime import offload

    resident, _ = greedy_decode(load_model(quantised), PROMPT, 12)
    dropped, read = [], []
    fadvise, preadv = os.posix_fadvise, os.preadv

    def drop(fd, offset, length, advice):
        dropped.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))
        return fadvise(fd, offset, length, advice)

    def spy_read(fd, views, offset):
        got = preadv(fd, views, offset)
        read.append((os.readlink(f"/proc/self/fd/{fd}"), offset, got))
        return got

    monkeypatch.setattr(offload.os, "posix_fadvise", drop)
    monkeypatch.setattr(offload.os, "preadv", spy_read)
    rt = load_model(quantised)
    cache = install_offload(rt, OffloadOptions(2, "lru", prefetch, reads="storage"))
    assert any(length == 0 and offset == 0 for _, offset, length, _ in dropped)  # the whole file, at the start
    logits, _ = greedy_decode(rt, PROMPT, 12)
    cache.remove()
    assert torch.equal(logits, resident)
    assert read and all(a == os.POSIX_FADV_DONTNEED for *_, a in dropped)
    for file, offset, got in read:
        assert any(f == file and o <= offset and offset + got <= o + n for f, o, n, _ in dropped if n), (offset, got)


def test_an_unknown_read_source_is_refused(tiny_models):
    rt = load_model(tiny_models["qwen3_moe"])
    with pytest.raises(InputError, match="page-cache, storage"):
        install_offload(rt, OffloadOptions(2, "lru", reads="disk"))


def test_offloaded_quantised_experts_give_back_their_kernel_tensors(quantised, tmp_path, monkeypatch):
    """A prepared QuantLinear holds its kernel's tensors, not the checkpoint's: offloading must drop those too. They
    are kept in the kernel's layout in a scratch file (unlinked at once), and a load reads them back as they were:
    no kernel is prepared again, and the logits are the resident model's."""
    from quantkit.runtime import dispatch
    from quantkit.runtime.linear import QuantLinear

    ref, _ = greedy_decode(load_model(quantised), PROMPT, 12)
    rt = load_model(quantised)
    before = rt.resident_weight_bytes
    cache = install_offload(rt, OffloadOptions(2, "lru", scratch_dir=str(tmp_path)))
    assert rt.resident_weight_bytes < before
    linears = [m for t in cache.templates.values() for m in t.modules() if isinstance(m, QuantLinear)]
    if not any(m.kernel is not None for m in linears):
        pytest.skip("no CPU kernel serves these linears here: they run the reference")
    assert all(t.is_meta for m in linears if m.kernel is not None for t in m.prepared.tensors())
    assert cache.stored and list(tmp_path.iterdir()) == []

    def prepare(*args, **kwargs):
        raise AssertionError("a load prepared a kernel")

    monkeypatch.setattr(dispatch, "prepare_layer", prepare)
    got, _ = greedy_decode(rt, PROMPT, 12)
    assert cache.stats.loads > 0 and torch.equal(got, ref)
    cache.remove()


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "qwen3_moe"])
def test_folded_router_ranks_as_the_routing_and_refuses_other_norms(tiny_models, family):
    from quantkit.runtime.moe import moe_blocks
    from quantkit.runtime.offload import folded_router

    rt = load_model(tiny_models[family], torch.float32)
    block = moe_blocks(rt.model)[0]
    norm = rt.model.model.layers[block.layer_index].post_attention_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)  # a trained-looking norm, not all ones
        folded = folded_router(block, norm)
        assert folded is not None
        h = torch.randn(64, folded.shape[1], generator=torch.Generator().manual_seed(1)) * 3
        got = F.linear(h, folded).topk(block.spec.top_k, dim=-1).indices.sort(-1).values
        want = block.predict(norm(h)).sort(-1).values
        assert torch.equal(got, want)

        class OnePlus(torch.nn.Module):  # Gemma's norm: (1 + weight) * h / rms
            def __init__(self, w):
                super().__init__()
                self.weight = w

            def forward(self, x):
                return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

        assert folded_router(block, OnePlus(norm.weight.detach().clone())) is None


def test_destinations_that_take_no_direct_read_get_a_copy_of_the_stored_bytes(quantised, monkeypatch):
    """Where a tensor's bytes cannot be read into its destination (a GPU tensor, another dtype), the stored tensor,
    checkpoint's or kernel's, is read into a CPU tensor and copied: the logits stay the resident model's."""
    from quantkit.runtime import offload

    ref, _ = greedy_decode(load_model(quantised), PROMPT, 12)
    rt = load_model(quantised)
    cache = install_offload(rt, OffloadOptions(2, "lru"))
    monkeypatch.setattr(offload.ExpertCache, "_byte_view", lambda self, name, info, dest: None)
    got, _ = greedy_decode(rt, PROMPT, 12)
    assert cache.stats.loads > 0 and torch.equal(got, ref)
    cache.remove()


def test_kernel_layouts_that_hold_other_tensors_are_prepared_again_after_each_load(quantised, monkeypatch):
    """A layout keeping tensors outside its fields (the CUDA kernels' checkpoint copy) cannot be stored field by
    field: its expert reads the checkpoint's tensors and prepares the kernel again; the logits stay the resident's."""
    from quantkit.runtime import dispatch, offload

    ref, _ = greedy_decode(load_model(quantised), PROMPT, 12)
    monkeypatch.setattr(offload, "_plain_layout", lambda prepared: False)
    prepared = []
    real = dispatch.prepare_layer
    monkeypatch.setattr(dispatch, "prepare_layer", lambda layer, *a: prepared.append(layer) or real(layer, *a))
    rt = load_model(quantised)
    cache = install_offload(rt, OffloadOptions(2, "lru"))
    assert not cache.stored
    prepared.clear()  # the load's own preparation
    got, _ = greedy_decode(rt, PROMPT, 12)
    assert cache.stats.loads > 0 and prepared and torch.equal(got, ref)
    cache.remove()


def test_a_scratch_folder_that_cannot_take_the_kernel_layouts_is_one_line(quantised, tmp_path):
    from quantkit.runtime.linear import QuantLinear

    rt = load_model(quantised)
    if all(m.kernel is None for m in rt.model.modules() if isinstance(m, QuantLinear)):
        pytest.skip("no CPU kernel serves these linears here: nothing goes to a scratch file")
    with pytest.raises(InputError, match="cannot create the offload scratch file in .*missing"):
        install_offload(rt, OffloadOptions(2, "lru", scratch_dir=str(tmp_path / "missing")))
    # Refused before any expert was put behind a cache: the model still decodes as it did.
    assert not any(type(m).__name__ == "_Standin" for m in rt.model.modules())
    ref, _ = greedy_decode(load_model(quantised), PROMPT, 6)
    assert torch.equal(greedy_decode(rt, PROMPT, 6)[0], ref)
