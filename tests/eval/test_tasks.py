"""Multiple-choice tasks: file validation (naming the bad line), the built-in set, and scores against a
plain per-choice re-implementation of lm-evaluation-harness's acc / acc_norm."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit.errors import InputError
from quantkit.eval.tasks import builtin_tasks, evaluate_task, load_task_file, resolve_tasks


def test_builtin_set_loads_and_rotates_the_answer_position():
    items = resolve_tasks(["builtin"])["general"]
    assert len(items) >= 40
    assert len({it.answer for it in items}) == 4  # the right answer is not always in one slot
    assert "general" in builtin_tasks()


@pytest.mark.parametrize("line,message", [
    ("{not json", "not valid JSON"),
    ('{"question": "q", "choices": ["a"], "answer": 0}', "at least two"),
    ('{"question": "q", "choices": ["a", "b"], "answer": 2}', "answer"),
    ('{"choices": ["a", "b"], "answer": 0}', "question"),
    ('["a", "b"]', "expected an object"),
])
def test_malformed_lines_are_named(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    good = json.dumps({"question": "q", "choices": ["a", "b"], "answer": "b"})
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(InputError, match=rf"t\.jsonl:3: .*{message}"):
        load_task_file(path)


def test_answer_may_be_the_choice_text(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": "b"}) + "\n")
    assert load_task_file(path)[0].answer == 1


def _plain_scores(model, tok, items):
    """One forward per choice, no batching; context/continuation split as lm-evaluation-harness does."""
    acc = acc_norm = 0
    for it in items:
        context = f"Question: {it.question}\nAnswer:"
        lls = []
        for choice in it.choices:
            ctx = tok(context, add_special_tokens=False).input_ids
            whole = tok(context + " " + choice, add_special_tokens=False).input_ids
            cont = whole[len(ctx):]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
            lls.append(sum(float(logp[len(ctx) - 1 + k, t]) for k, t in enumerate(cont)))
        acc += lls.index(max(lls)) == it.answer
        norm = [ll / len(c) for ll, c in zip(lls, it.choices)]
        acc_norm += norm.index(max(norm)) == it.answer
    return acc / len(items), acc_norm / len(items)


def test_scores_match_a_plain_per_choice_implementation(tiny_models):
    from quantkit.runtime import load_model

    path = tiny_models["llama"]
    items = resolve_tasks(["general"])["general"][:12]
    tok = AutoTokenizer.from_pretrained(path)
    got = evaluate_task(load_model(path), tok, items)
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    acc, acc_norm = _plain_scores(ref, tok, items)
    assert got["n"] == 12
    assert got["acc"] == pytest.approx(acc) and got["acc_norm"] == pytest.approx(acc_norm)
