"""`quantkit eval --speculative`: how well a checkpoint drafts for, and verifies, speculative decoding.

For each target: plain decoding of every prompt (the reference output and the speed baseline, same loop and
cache code), then speculative decoding with the draft; acceptance rate (accepted draft tokens over the most
each step could accept: the tree's depth), mean accepted length (1 + accepted / steps), acceptance per draft
position, draft and verify time, tokens/s and the speed-up, and whether every greedy output is identical to
plain decoding: per prompt, the first generated token where it is not (`first_divergence`), and how many prompts
diverge. In fp32 speculative greedy decoding reproduces plain decoding; in bf16 it can diverge without any error in
acceptance, because verifying k tokens in one k-row forward rounds differently from k one-row steps, and where the top
two logits are closer than that rounding the argmax flips (then every later token differs too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import InputError

BUILTIN_CHAT = Path(__file__).resolve().parents[1] / "builtin" / "prompts" / "chat.jsonl"
DRAFT_KINDS = "a checkpoint folder, eagle:DIR, medusa:DIR (quantkit draft-heads), self:W4A8, self:W4A4, self:skip:N or ngram"


@dataclass(frozen=True)
class SpecOptions:
    draft: str | None = None  # the --speculative value
    draft_tokens: int = 4
    tree: str = "chain"
    prompts: str = "builtin"
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    grid: bool = False
    save_outputs: Path | None = None
    draft_vocab: int = 0  # a model draft scores only this many tokens, the calibration text's most frequent (0: all)

    @property
    def enabled(self) -> bool:
        return bool(self.draft) or self.grid


def validate(opts: SpecOptions) -> None:
    from quantkit.runtime.speculative import parse_tree

    parse_tree(opts.tree, opts.draft_tokens)
    if opts.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {opts.max_new_tokens}")
    if opts.temperature < 0:
        raise InputError(f"--temperature must be >= 0, got {opts.temperature}")
    fitted = bool(opts.draft) and opts.draft.startswith(("medusa:", "eagle:"))
    if fitted and opts.draft_vocab:
        raise InputError("--draft-vocab: a fitted drafter's vocabulary is chosen when it is fitted "
                         "(quantkit draft-heads --draft-vocab)")
    if opts.draft_vocab < 0:
        raise InputError(f"--draft-vocab must be >= 0 (0: the whole vocabulary), got {opts.draft_vocab}")
    if opts.draft_vocab and (opts.draft == "ngram" or opts.grid):
        raise InputError("--draft-vocab applies to a model draft (a checkpoint or self:...), not to ngram or the grid")
    if opts.draft == "ngram" and opts.tree.split(":")[0] not in ("chain", "static"):
        raise InputError("--speculative ngram drafts chains and static trees only (--tree chain or static:WxD)")
    # The draft itself, before any model work (a wrong path once surfaced after the whole KL pass)
    if fitted:
        from quantkit.formats import drafter

        kind, _, folder = opts.draft.partition(":")
        drafter.read(Path(folder), kind)
    elif opts.draft and opts.draft.startswith("self:"):
        from quantkit.runtime.speculative.drafts import SELF_DRAFT_BITS, SELF_DRAFTS, skip_layers

        scheme = opts.draft.split(":", 1)[1]
        if skip_layers(scheme) is None and scheme.upper() not in SELF_DRAFT_BITS:
            raise InputError(f"unknown self-draft {opts.draft!r}; use {SELF_DRAFTS}")
    elif opts.draft and opts.draft != "ngram":
        from quantkit.eval.runner import check_checkpoint

        if not Path(opts.draft).exists():
            raise InputError(f"--speculative {opts.draft!r} is neither {DRAFT_KINDS}")
        check_checkpoint(Path(opts.draft))


def load_prompts(source: str, tokenizer, seed: int = 0) -> list[list[int]]:
    """Token ids of each prompt: `builtin` = 32 held-out KJV openings (48 tokens) + 32 chat-style requests (in the
    tokenizer's chat template where it has one); or a .jsonl file ({"prompt": str} per line) / .txt file (one per
    line)."""
    if source == "builtin":
        from quantkit.data.calibration import build_token_blocks

        kjv = build_token_blocks(tokenizer, "kjv", 32, 48, seed=seed, split="heldout").input_ids.tolist()
        return kjv + [_encode(tokenizer, p) for p in _read_prompt_file(BUILTIN_CHAT)]
    path = Path(source)
    if not path.is_file():
        raise InputError(f"prompt file {path} does not exist (or use --prompts builtin)")
    prompts = [p if isinstance(p, list) else _encode(tokenizer, p) for p in _read_prompt_file(path)]
    vocab = len(tokenizer)
    for i, p in enumerate(prompts, 1):
        if max(p) >= vocab:
            raise InputError(f"{path}: prompt {i} has token id {max(p)}, outside the tokenizer's {vocab} ids")
    return prompts


def _read_prompt_file(path: Path) -> list[str | list[int]]:
    """Prompts as text, or as token ids where a JSONL line gives {"ids": [int, ...]} (already tokenised)."""
    out: list[str | list[int]] = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                out.append(line.rstrip("\n"))
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            ids = row.get("ids") if isinstance(row, dict) else None
            if isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                     for i in ids):
                out.append(ids)
                continue
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise InputError(f'{path}:{n}: expected an object with a non-empty "prompt" string '
                                 f'(or "ids": a list of token ids)')
            out.append(row["prompt"])
    if not out:
        raise InputError(f"prompt file {path} has no prompts")
    return out


def _encode(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return list(ids)
    return tokenizer(text).input_ids


def check_same_tokenizer(target_tok, draft_tok, target: str, draft: str) -> None:
    if draft_tok is None:
        raise InputError(f"draft {draft} has no tokenizer that transformers can load")
    a, b = target_tok.get_vocab(), draft_tok.get_vocab()
    if a != b:
        if len(a) != len(b):
            why = f"vocabulary sizes {len(a)} and {len(b)}"
        else:
            tok = next(t for t in sorted(a) if a.get(t) != b.get(t))
            why = f"token {tok!r} is id {a.get(tok)} in the target and {b.get(tok)} in the draft"
        raise InputError(f"draft {draft} does not share the target's tokenizer ({why}); speculative decoding "
                         f"needs the same token ids")


DRAFT_VOCAB_BLOCKS = (128, 16, 2)  # 512-token calibration blocks counted for a restricted draft vocabulary: the
# most the dataset has of these


def frequent_tokens(tokenizer, dataset: str, count: int, seed: int, text_column: str | None = None):
    """The `count` most frequent token ids of the dataset's calibration split (never the held-out text eval scores),
    the special tokens (end of sequence, chat markers) a generation needs first."""
    import torch

    from quantkit.data.calibration import build_token_blocks

    for blocks in DRAFT_VOCAB_BLOCKS:
        try:
            ids = build_token_blocks(tokenizer, dataset, blocks, 512, seed, split="calibration",
                                     text_column=text_column).input_ids
            break
        except InputError as exc:
            why = exc  # too little text for this many blocks, or a dataset that cannot be read: its own words
    else:
        raise InputError(f"--draft-vocab: {why}")
    counts = torch.bincount(ids.flatten(), minlength=len(tokenizer))
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    counts[special[special < len(counts)]] = counts.max() + 1
    return torch.sort(torch.topk(counts, min(count, len(counts))).indices).values


def make_draft(spec: str, target_rt, target_tok, dtype, device, label: str):
    from quantkit.eval.runner import _tokenizer, check_checkpoint
    from quantkit.runtime.model import load_model
    from quantkit.runtime.speculative import ModelDraft, NgramDraft, self_draft

    if spec == "ngram":
        return NgramDraft()
    if spec.startswith("self:"):
        return self_draft(target_rt, spec.split(":", 1)[1])
    if spec.startswith(("eagle:", "medusa:")):
        from quantkit.runtime.speculative.heads import load_draft

        return load_draft(spec, target_rt)
    path = Path(spec)
    if not path.exists():
        raise InputError(f"draft {spec!r} is neither {DRAFT_KINDS}")
    path = check_checkpoint(path)
    check_same_tokenizer(target_tok, _tokenizer(path), label, str(path))
    return ModelDraft(load_model(path, dtype, device), str(path))


def check_context(prompts: list[list[int]], opts: SpecOptions, config) -> None:
    from quantkit.runtime.speculative import parse_tree

    limit = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                    "max_position_embeddings", None)
    nodes = parse_tree(opts.tree, opts.draft_tokens).max_nodes
    need = max(len(p) for p in prompts) + opts.max_new_tokens + nodes + 1
    if limit and need > limit:
        raise InputError(f"the longest prompt + --max-new-tokens + the tree's {nodes} nodes need {need} positions "
                         f"but the model has {limit}; use a smaller tree or fewer new tokens")


def plain_outputs(target_rt, prompts: list[list[int]], opts: SpecOptions, eos: int | None) -> dict:
    from quantkit.runtime.speculative.decode import plain_generate

    tokens, seconds = [], 0.0
    for i, p in enumerate(prompts):
        out, s = plain_generate(target_rt, p, opts.max_new_tokens, opts.temperature, opts.seed + i, eos)
        tokens.append(out)
        seconds += s
    return {"tokens": tokens, "seconds": seconds, "generated": sum(len(t) for t in tokens)}


def run_draft(target_rt, draft, prompts: list[list[int]], opts: SpecOptions, plain: dict, eos: int | None,
              progress=None) -> dict:
    """Speculative decoding of every prompt with `draft`; the metrics, keyed as the JSON report keeps them."""
    from quantkit.runtime.speculative import SpecConfig, parse_tree, speculative_generate
    from quantkit.runtime.speculative.drafts import weight_bytes_per_token
    from quantkit.runtime.speculative.trees import AcceptanceRates

    tree = parse_tree(opts.tree, opts.draft_tokens)
    rates = AcceptanceRates()  # OPT-Tree learns the acceptance of this draft on this target across prompts
    outs, totals = [], {"steps": 0, "accepted": 0, "depth": 0, "draft_s": 0.0, "verify_s": 0.0, "wall": 0.0}
    drafted: list[int] = []
    accepted: list[int] = []
    for i, p in enumerate(prompts):
        cfg = SpecConfig(tree=tree, max_new_tokens=opts.max_new_tokens, temperature=opts.temperature,
                         seed=opts.seed + i, eos_token_id=eos)
        r = speculative_generate(target_rt, draft, p, cfg, rates)
        outs.append(r.tokens)
        totals["steps"] += r.steps
        totals["accepted"] += r.accepted
        totals["depth"] += r.drafted_depth
        totals["draft_s"] += r.draft_seconds
        totals["verify_s"] += r.verify_seconds
        totals["wall"] += r.wall_seconds
        for d, (n, a) in enumerate(zip(r.per_position_drafted, r.per_position_accepted)):
            if d >= len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[d] += n
            accepted[d] += a
        if progress:
            progress()
    generated = sum(len(t) for t in outs)
    tps = generated / totals["wall"] if totals["wall"] else 0.0
    plain_tps = plain["generated"] / plain["seconds"] if plain["seconds"] else 0.0
    # Greedy only (a sampled output is a different draw): where each prompt's output first leaves plain decoding's.
    divergence = [first_divergence(a, b) for a, b in zip(outs, plain["tokens"])] if opts.temperature <= 0 else None
    identical = None if divergence is None else all(d is None for d in divergence)
    vocab = getattr(draft, "vocabulary", None)
    draft_bytes, target_bytes = getattr(draft, "bytes_per_token", None), weight_bytes_per_token(target_rt)
    return {
        "draft": getattr(draft, "name", str(draft)),
        "draft_vocab": None if vocab is None else len(vocab),
        # What a step reads, draft against target: a draft pays only if it reads far less (batch-1 decode is
        # bandwidth-bound).
        "draft_bytes_per_token": draft_bytes,
        "target_bytes_per_token": target_bytes,
        "draft_bytes_ratio": draft_bytes / target_bytes if draft_bytes is not None and target_bytes else None,
        # QSPEC W4A8: how many decoder linears ran the integer kernel on int8 codes (the rest fake-quantise)
        "draft_int8_linears": getattr(draft, "int8_linears", None),
        "tree": tree.describe(),
        "temperature": opts.temperature,
        "acceptance_rate": totals["accepted"] / totals["depth"] if totals["depth"] else 0.0,
        "mean_accepted_length": 1 + totals["accepted"] / totals["steps"] if totals["steps"] else 1.0,
        "per_position_acceptance": [a / n if n else 0.0 for a, n in zip(accepted, drafted)],
        "draft_seconds": totals["draft_s"],
        "verify_seconds": totals["verify_s"],
        "tokens_per_s": tps,
        "plain_tokens_per_s": plain_tps,
        "speedup": tps / plain_tps if plain_tps else 0.0,
        "identical_to_plain": identical,
        "diverged_prompts": None if divergence is None else sum(d is not None for d in divergence),
        "first_divergence": divergence,
        "prompts": len(prompts),
        "generated_tokens": generated,
        "outputs": outs,
    }


def first_divergence(spec: list[int], plain: list[int]) -> int | None:
    """The index of the first generated token where `spec` differs from `plain` (the shorter one's length where one
    is a prefix of the other), or None where they are equal."""
    for i, (a, b) in enumerate(zip(spec, plain)):
        if a != b:
            return i
    return None if len(spec) == len(plain) else min(len(spec), len(plain))


def output_lines(checkpoint: str, outputs: list[list[int]], speculative: bool, draft: str | None = None) -> list[dict]:
    return [{"checkpoint": checkpoint, "prompt_index": i, "tokens": t, "speculative": speculative,
             **({"draft": draft} if draft else {})} for i, t in enumerate(outputs)]


def save_outputs(path: Path, lines: list[dict]) -> None:
    """One JSON line per prompt (and checkpoint): `prompt_index`, `tokens`; written whole or not at all."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(json.dumps(line) + "\n")
    tmp.replace(path)
