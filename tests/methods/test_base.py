"""Helpers shared by the methods."""

from __future__ import annotations

import gc
import weakref

import torch

from quantkit.methods.base import SharedInputs


def test_shared_inputs_find_leaders_without_keeping_inputs_alive():
    shared = SharedInputs(keep=8)
    x = torch.randn(4, 8)
    assert shared.see("q_proj", x) == "q_proj"
    assert shared.see("k_proj", x) == "q_proj"  # same tensor object: one statistic for both
    y = torch.randn(4, 8)
    assert shared.see("o_proj", y) == "o_proj"
    assert shared.see("v_proj", x) == "q_proj"
    # Past batches' activations must be freed as soon as the model lets go of them: a remembered input held
    # by the helper would stay resident for up to `keep` more calls.
    probe = weakref.ref(x)
    del x
    gc.collect()
    assert probe() is None
    z = torch.randn(4, 8)  # a new tensor (possibly at the freed address) is not mistaken for the old one
    assert shared.see("gate_proj", z) == "gate_proj"
    assert shared.leader("k_proj") == "q_proj" and shared.leader("down_proj") == "down_proj"
