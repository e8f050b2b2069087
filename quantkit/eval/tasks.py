"""Multiple-choice log-likelihood tasks from local JSONL, scored as lm-evaluation-harness scores them.

One line per question: {"question": str, "choices": [str, ...], "answer": int (index) or the right choice's
text}. The context is "Question: <question>\\nAnswer:" and each continuation " <choice>"; the continuation's
tokens are what the tokenised context+continuation adds to the tokenised context. acc picks the choice
with the highest summed log-likelihood; acc_norm divides each by the choice's length in characters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.errors import InputError



@dataclass(frozen=True)
class MCItem:
    question: str
    choices: tuple[str, ...]
    answer: int


def builtin_tasks() -> dict[str, Path]:
    from quantkit.resources import builtin_file, builtin_names

    return {name: Path(str(builtin_file("tasks", name, ".jsonl"))) for name in builtin_names("tasks", ".jsonl")}


def load_task_file(path: Path) -> list[MCItem]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"task file {path} does not exist")
    items = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise InputError(f"{where}: expected an object with question, choices, answer")
            q, choices, answer = row.get("question"), row.get("choices"), row.get("answer")
            if not isinstance(q, str) or not q.strip():
                raise InputError(f"{where}: `question` must be a non-empty string")
            if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
                raise InputError(f"{where}: `choices` must be a list of at least two non-empty strings")
            if isinstance(answer, str) and answer in choices:
                answer = choices.index(answer)
            if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
                raise InputError(f"{where}: `answer` must be a choice index in 0..{len(choices) - 1} or a choice's text")
            items.append(MCItem(q.strip(), tuple(choices), answer))
    if not items:
        raise InputError(f"task file {path} has no questions")
    return items


def resolve_tasks(specs: list[str]) -> dict[str, list[MCItem]]:
    """Task files by path, or built-in sets by name ("builtin" = all of them)."""
    out: dict[str, list[MCItem]] = {}
    known = builtin_tasks()
    for spec in specs:
        for part in [s for s in spec.split(",") if s]:
            if part == "builtin":
                for name, path in known.items():
                    out[name] = load_task_file(path)
            elif part in known and not Path(part).exists():
                out[part] = load_task_file(known[part])
            else:
                out[Path(part).stem] = load_task_file(Path(part))
    return out


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids as lm-evaluation-harness splits them (trailing context spaces move over)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    bos = tokenizer.bos_token_id
    if bos is not None and tokenizer("a").input_ids[:1] == [bos]:
        whole, ctx = [bos] + whole, [bos] + ctx
    return ctx, whole[len(ctx):]


@torch.inference_mode()
def choice_logliks(model, tokenizer, context: str, choices: tuple[str, ...], device) -> list[float]:
    """Summed log-likelihood of each " choice" after `context`, all choices in one right-padded batch."""
    pairs = [encode_pair(tokenizer, context, " " + c) for c in choices]
    seqs = [ctx + cont for ctx, cont in pairs]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
    # Right padding needs no mask: causal attention never lets a real position see the padding after it.
    logp = torch.log_softmax(model(input_ids=ids.to(device)).logits.double(), dim=-1).cpu()
    out = []
    for r, (ctx, cont) in enumerate(pairs):
        pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
        out.append(float(logp[r, pos, torch.tensor(cont)].sum()))
    return out


def evaluate_task(model, tokenizer, items: list[MCItem], device="cpu") -> dict:
    correct = correct_norm = 0
    for item in items:
        ll = choice_logliks(model, tokenizer, f"Question: {item.question}\nAnswer:", item.choices, device)
        norm = [v / len(c) for v, c in zip(ll, item.choices)]
        correct += int(max(range(len(ll)), key=ll.__getitem__) == item.answer)
        correct_norm += int(max(range(len(norm)), key=norm.__getitem__) == item.answer)
    n = len(items)
    return {"acc": correct / n, "acc_norm": correct_norm / n, "n": n}
