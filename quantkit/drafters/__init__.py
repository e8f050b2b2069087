"""Drafters fitted to the model that will be served: `quantkit draft-heads` (fit.py: the distillation; the folder
layout is quantkit/formats/drafter.py; the runtime drafts with quantkit/runtime/speculative/heads.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import InputError


@dataclass(frozen=True)
class DraftHeadsOptions:
    checkpoint: Path
    output: Path
    kind: str = "eagle"
    heads: int = 4
    dataset: str = "kjv:0.5,self:0.5"  # the built-in text and the target's own
    num_samples: int = 80
    seq_len: int = 512
    steps: int = 400
    draft_vocab: int = 8192
    seed: int = 0
    compute_dtype: str = "auto"
    overwrite: bool = False


def validate(opts: DraftHeadsOptions) -> None:
    from quantkit.runtime.speculative.heads import KINDS

    if opts.kind not in KINDS:
        raise InputError(f"unknown --kind {opts.kind!r}; use {' or '.join(KINDS)}")
    for flag, value, least in (("--heads", opts.heads, 1), ("--num-samples", opts.num_samples, 2),
                               ("--seq-len", opts.seq_len, 8), ("--steps", opts.steps, 1),
                               ("--draft-vocab", opts.draft_vocab, 0)):
        if value < least:
            raise InputError(f"{flag} must be at least {least}, got {value}")
    if opts.output.exists() and not opts.overwrite:
        raise InputError(f"{opts.output} exists; pass --overwrite to replace it")


def run_draft_heads(opts: DraftHeadsOptions) -> dict:
    import torch

    from quantkit.drafters.data import fit_text
    from quantkit.drafters.fit import FitConfig, data_fingerprint, drafter_tensors, fit
    from quantkit.eval.runner import _tokenizer, check_checkpoint, compute_for
    from quantkit.formats import drafter as fmt
    from quantkit.formats.files import publish
    from quantkit.formats.manifest import package_versions
    from quantkit.progress import progress_bar
    from quantkit.runtime.model import load_model
    from quantkit.runtime.speculative.heads import eagle_layer_config

    validate(opts)
    start = time.perf_counter()
    path = check_checkpoint(Path(opts.checkpoint))
    tok = _tokenizer(path)
    if tok is None:
        raise InputError(f"{path} has no tokenizer that transformers can load; draft-heads fits on tokenised text")
    device = torch.device("cpu")
    compute = compute_for(path, opts.compute_dtype, device)
    target = load_model(path, compute.dtype, device)
    cfg = FitConfig(kind=opts.kind, heads=opts.heads, steps=opts.steps, draft_vocab=opts.draft_vocab,
                    seed=opts.seed, eval_every=max(1, opts.steps // 6))
    layer_config = eagle_layer_config(target.config) if opts.kind == "eagle" else None
    with progress_bar() as bar:
        text_task = bar.add_task("fit text", total=opts.num_samples, info=opts.dataset)
        ids = fit_text(target, tok, opts.dataset, opts.num_samples, opts.seq_len, opts.seed,
                       lambda n: bar.update(text_task, advance=n))
        bar.update(text_task, completed=opts.num_samples)
        feat_task = bar.add_task("target features", total=len(ids), info="")
        fit_task = bar.add_task(f"fit {opts.kind}", total=cfg.steps, info="")

        def progress(phase: str, n: int, loss: float | None = None) -> None:
            if phase == "features":
                bar.update(feat_task, advance=n)
            elif phase == "fit":
                bar.update(fit_task, advance=n, info=f"train loss {loss:.3f}")
            else:
                bar.update(fit_task, info=f"held-out loss {loss:.3f}")

        result = fit(target, ids, cfg, sorted(set(tok.all_special_ids)), progress, layer_config)
    vocab = target.vocab_size
    meta = {"kind": opts.kind, "hidden_size": result.module.hidden_size, "vocab_size": vocab,
            "draft_vocab": None if result.vocabulary is None else len(result.vocabulary),
            "target_fingerprint": fmt.target_fingerprint(path)}
    architectures = list(getattr(target.config, "architectures", None) or [])
    config = (fmt.eagle_config(layer_config, meta, str(path), architectures) if opts.kind == "eagle"
              else fmt.medusa_config(opts.heads, result.module.hidden_size, meta, str(path)))
    last = result.history[-1]
    report = {
        "checkpoint": str(path), "output": str(opts.output), "kind": opts.kind,
        "heads": opts.heads if opts.kind == "medusa" else None,
        "compute_dtype": str(compute.dtype).replace("torch.", ""),
        "data": {"dataset": opts.dataset, "num_samples": opts.num_samples, "seq_len": opts.seq_len, "seed": opts.seed,
                 "fingerprint": data_fingerprint(ids), "heldout_sequences": max(1, opts.num_samples // 8)},
        "steps": cfg.steps, "draft_vocab": meta["draft_vocab"],
        "parameters": sum(p.numel() for p in result.module.parameters()),
        "untrained": result.untrained, "trained": {k: last[k] for k in ("heldout_loss", "top1_agreement")},
        "history": result.history,
        "seconds": {**{k: round(v, 2) for k, v in result.seconds.items()},
                    "total": round(time.perf_counter() - start, 2)},
    }
    manifest = {"quantkit_draft_heads": 1, "target": {"path": str(path), "fingerprint": meta["target_fingerprint"]},
                "packages": package_versions(), **{k: report[k] for k in ("kind", "heads", "data", "steps",
                                                                         "draft_vocab", "untrained", "trained",
                                                                         "history", "seconds")}}
    partial = opts.output.with_name(opts.output.name + ".partial")
    if partial.exists():
        import shutil

        shutil.rmtree(partial)
    fmt.save(partial, config, drafter_tensors(result), manifest)
    publish(partial, opts.output)
    return report
