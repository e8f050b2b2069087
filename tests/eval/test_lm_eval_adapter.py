"""--lm-eval: a clear message without the package; with it, the harness interface scores like our tasks do."""

import importlib.util
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from quantkit.errors import InputError


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is not None, reason="lm-eval is installed")
def test_missing_lm_eval_is_a_clear_error(tiny_models):
    from quantkit.eval.lm_eval_adapter import run_lm_eval

    with pytest.raises(InputError, match=r"not installed: pip install .quantkit-llm\[lm-eval\]."):
        run_lm_eval(None, None, "hellaswag")


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="needs lm-eval")
def test_loglikelihood_matches_task_scoring(tiny_models):
    from quantkit.eval.lm_eval_adapter import _make_lm_class
    from quantkit.eval.tasks import choice_logliks
    from quantkit.runtime import load_model

    rt = load_model(tiny_models["llama"])
    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    lm = _make_lm_class()(rt, tok)
    context, choices = "Question: what is ice?\nAnswer:", ("frozen water", "hot sand")
    got = [ll for ll, _ in lm.loglikelihood([SimpleNamespace(args=(context, " " + c)) for c in choices])]
    assert got == pytest.approx(choice_logliks(rt, tok, context, choices, "cpu"), rel=1e-6)
