"""Expert offloading (quantkit/runtime/offload.py): exact logits, residency bounds, policies, prefetch."""

from __future__ import annotations

import pytest
import torch

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
def test_draft_prefetch_predicts_and_raises_the_hit_rate(tiny_models, overlap):
    import threading

    path = tiny_models["qwen3_moe"]
    rates, threads = {}, set()
    for prefetch in (False, True):
        rt = load_model(path)
        cache = install_offload(rt, OffloadOptions(2, "lru", prefetch, overlap=overlap))
        fill = cache._fill

        def spy(layer, expert, module, fill=fill):
            threads.add(threading.current_thread().name.split("_")[0])
            return fill(layer, expert, module)

        cache._fill = spy
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


def test_offloaded_quantised_experts_give_back_their_kernel_tensors(quantised):
    # A prepared QuantLinear holds its kernel's tensors, not the checkpoint's: offloading must drop those too.
    rt = load_model(quantised)
    before = rt.resident_weight_bytes
    cache = install_offload(rt, OffloadOptions(2, "lru"))
    assert rt.resident_weight_bytes < before
    for template in cache.templates.values():
        assert all(m.prepared is None for m in template.modules() if hasattr(m, "prepared"))
