"""`quantkit draft-heads`: fit an EAGLE drafter or Medusa heads to a target checkpoint by distillation.

The target (quantised or not, as it will be served) runs the calibration text once in quantkit's runtime; its
features (what its head reads) and, through its own head, its next-token distributions are the training signal,
not the text's tokens: the drafter learns what this target predicts, quantisation error included.

Losses, per position (p = the target's distribution, q = the drafter's, both over the draft vocabulary and seen
as the target's TARGET_TOP likeliest tokens plus one bucket for the rest: p is computed once, before the fit):
- EAGLE: KL(p || q) of the next position, plus a smooth-L1 regression of the predicted feature
  on the target's (EAGLE-1); the input features get uniform noise (EAGLE's augmentation), so the drafter also copes
  with its own, imperfect, predicted features when it drafts deeper. A second unrolled step (input: its own
  predictions) trains exactly that case.
- Medusa: head k's KL(p || q) of position t+k, weighted 0.8^(k-1) (Medusa-1).
A held-out eighth of the sequences scores each evaluation: the distillation loss and how often the drafter's top
token is the target's (over the whole vocabulary), per draft depth.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from quantkit.errors import InputError

NOISE = 0.2  # EAGLE's uniform feature noise, as a fraction of the features' RMS
MEDUSA_DECAY = 0.8
TARGET_TOP = 128  # tokens a position's loss tells apart (SmolLM2: ~0.94 of the mass); the rest is one bucket


@dataclass(frozen=True)
class FitConfig:
    kind: str  # eagle | medusa
    heads: int = 4  # Medusa heads
    steps: int = 400
    batch_size: int = 4  # sequences per step
    lr: float = 2e-3
    draft_vocab: int = 8192  # 0: the whole vocabulary
    seed: int = 0
    eval_every: int = 50
    unroll: bool = True  # EAGLE: train the second draft step on its own predicted features too
    bf16: bool = True  # matmuls under bf16 autocast (the weights, optimiser and losses stay fp32)


@dataclass
class FitResult:
    module: nn.Module
    vocabulary: torch.Tensor | None
    history: list[dict] = field(default_factory=list)  # step, heldout loss, top-1 agreement per depth
    untrained: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)


def collect_features(target, ids: torch.Tensor, batch: int = 4, progress=None) -> torch.Tensor:
    """[N, L, H] the target's features of every position of `ids` [N, L] (in its compute dtype)."""
    from quantkit.runtime.speculative.drafts import _network
    from quantkit.runtime.speculative.heads import _decoder

    decoder = _decoder(_network(target))
    device = _network(target).device
    out = []
    with torch.inference_mode():
        for i in range(0, ids.shape[0], batch):
            chunk = ids[i : i + batch].to(device)
            res = decoder(input_ids=chunk, use_cache=False)
            out.append((res[0] if isinstance(res, (tuple, list)) else res.last_hidden_state).cpu())
            if progress:
                progress(len(chunk))
    return torch.cat(out)


def head_weight(target) -> torch.Tensor:
    """The target's output head as a dense [V, H] weight (a quantised head dequantised)."""
    from quantkit.runtime.speculative.drafts import _network, vocabulary_head

    head = _network(target).get_output_embeddings()
    return vocabulary_head(target, torch.arange(head.out_features)).weight.detach()


def target_predictions(features: torch.Tensor, weight: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """[N, L] the target's greedy next token at every position (over the whole vocabulary)."""
    flat = features.reshape(-1, features.shape[-1])
    w = weight.to(flat.dtype)
    out = torch.empty(flat.shape[0], dtype=torch.long)
    for i in range(0, flat.shape[0], chunk):
        out[i : i + chunk] = (flat[i : i + chunk] @ w.T).argmax(-1)
    return out.reshape(features.shape[:-1])


def select_vocabulary(ids: torch.Tensor, predicted: torch.Tensor, count: int, vocab: int,
                      special: list[int]) -> torch.Tensor | None:
    """The `count` tokens the target most often predicts on the fit text (ties: the text's own counts), special
    tokens first; None for the whole vocabulary."""
    if count <= 0 or count >= vocab:
        return None
    score = torch.bincount(predicted.flatten(), minlength=vocab).double() * (vocab + 1)
    score += torch.bincount(ids.flatten().clamp(max=vocab - 1), minlength=vocab).double()
    special_ids = torch.tensor([s for s in special if 0 <= s < vocab], dtype=torch.long)
    score[special_ids] = float("inf")
    return torch.sort(torch.topk(score, count).indices).values


def target_top(features: torch.Tensor, head: torch.Tensor, k: int = TARGET_TOP) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's `k` most likely tokens at every position over the draft head's rows: ([..., k] their
    log-probabilities, [..., k] their rows). Computed once, so a fit step never runs the target's head."""
    flat = features.reshape(-1, features.shape[-1])
    k = min(k, head.shape[0])
    chunk = max(64, (1 << 25) // head.shape[0])  # rows whose fp32 logits take ~128 MB, whatever the vocabulary
    logp = torch.empty(flat.shape[0], k)
    idx = torch.empty(flat.shape[0], k, dtype=torch.int32)
    for i in range(0, flat.shape[0], chunk):
        top = torch.topk(torch.log_softmax(flat[i : i + chunk].float() @ head.float().T, -1), k, dim=-1)
        logp[i : i + chunk] = top.values
        idx[i : i + chunk] = top.indices.to(torch.int32)
    shape = (*features.shape[:-1], k)
    return logp.reshape(shape), idx.reshape(shape)


def _log_rest(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(logp))) over the last axis: the log-probability of every token outside the top ones."""
    return torch.log((1 - logp.exp().sum(-1)).clamp_min(1e-9))


def _kl(logits: torch.Tensor, top_logp: torch.Tensor, top_idx: torch.Tensor) -> torch.Tensor:
    """Mean KL(p || q) of the target's distribution p and the drafter's q, both seen as the target's top tokens and
    one bucket for the rest (0 for a perfect drafter; the gradient is the cross-entropy's)."""
    logq = torch.log_softmax(logits.float(), -1).gather(-1, top_idx.long())
    p = top_logp.exp()
    rest_p, rest_q = _log_rest(top_logp), _log_rest(logq)
    return ((p * (top_logp - logq)).sum(-1) + rest_p.exp() * (rest_p - rest_q)).mean()


class _Batches:
    def __init__(self, n: int, batch: int, seed: int):
        self.n, self.batch = n, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def next(self) -> list[int]:
        if len(self.order) < self.batch:
            self.order += torch.randperm(self.n, generator=self.gen).tolist()
        out, self.order = self.order[: self.batch], self.order[self.batch :]
        return out


def prepare(target, ids: torch.Tensor, cfg: FitConfig, special: list[int], progress=None) -> "_Data":
    """The target's side of the fit, computed once: features, embeddings, greedy tokens, the draft vocabulary."""
    from quantkit.runtime.speculative.drafts import _network

    if ids.shape[0] < 2:
        raise InputError("draft-heads needs at least 2 sequences (--num-samples): one eighth is held out")
    if cfg.kind == "medusa" and ids.shape[1] <= cfg.heads + 1:
        raise InputError(f"--seq-len {ids.shape[1]} is too short for {cfg.heads} Medusa heads")
    t0 = time.perf_counter()
    feats = collect_features(target, ids, progress=progress and (lambda n: progress("features", n)))
    net = _network(target)
    weight = head_weight(target).float()
    predicted = target_predictions(feats, weight)
    vocabulary = select_vocabulary(ids, predicted, cfg.draft_vocab, weight.shape[0], special)
    embed = net.get_input_embeddings()
    with torch.inference_mode():  # the drafter reads the target's embedding of a token: its table as it runs
        table = embed(torch.arange(embed.num_embeddings, device=net.device)).float().cpu()
    feats = feats.float()
    head = weight if vocabulary is None else weight[vocabulary]
    top_logp, top_idx = target_top(feats, head)
    return _Data(feats, ids, table, predicted, head, vocabulary, feats.pow(2).mean().sqrt(), top_logp, top_idx,
                 time.perf_counter() - t0)


def train(data: "_Data", cfg: FitConfig, layer_config=None, progress=None) -> FitResult:
    """Fit a drafter of `cfg.kind` on prepared target data (`layer_config`: EAGLE's decoder layer)."""
    from quantkit.runtime.speculative.heads import EagleDrafter, MedusaHeads

    torch.manual_seed(cfg.seed)
    n = data.feats.shape[0]
    held = max(1, n // 8)
    heldout = slice(0, held)
    if cfg.kind == "eagle":
        if layer_config is None:
            raise ValueError("an EAGLE drafter needs its decoder layer's config")
        module: nn.Module = EagleDrafter(layer_config)
    else:
        module = MedusaHeads(data.feats.shape[-1], cfg.heads)
    module.float().train()
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=0.0)
    warmup = max(1, cfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    result = FitResult(module, data.vocabulary, seconds={"target_forward": data.seconds})
    result.untrained = _evaluate(module, data, heldout, cfg)
    batches = _Batches(n - held, cfg.batch_size, cfg.seed)
    t0 = time.perf_counter()
    for s in range(cfg.steps):
        rows = [held + r for r in batches.next()]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = _loss(module, data, rows, cfg, train=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        sched.step()
        loss = float(loss.detach())
        if progress:
            progress("fit", 1, loss)
        if (s + 1) % cfg.eval_every == 0 or s + 1 == cfg.steps:
            result.history.append({"step": s + 1, "train_loss": loss, **_evaluate(module, data, heldout, cfg)})
            if progress:
                progress("eval", 0, result.history[-1]["heldout_loss"])
    result.seconds["fit"] = time.perf_counter() - t0
    module.eval()
    return result


def fit(target, ids: torch.Tensor, cfg: FitConfig, special: list[int], progress=None,
        layer_config=None) -> FitResult:
    """Fit a drafter of `cfg.kind` to `target` on the token blocks `ids` [N, L] (N >= 2: a held-out eighth)."""
    from quantkit.runtime.speculative.drafts import _network
    from quantkit.runtime.speculative.heads import eagle_layer_config

    data = prepare(target, ids, cfg, special, progress)
    if cfg.kind == "eagle" and layer_config is None:
        layer_config = eagle_layer_config(_network(target).config)
    return train(data, cfg, layer_config, progress)


@dataclass
class _Data:
    feats: torch.Tensor  # [N, L, H] float
    ids: torch.Tensor  # [N, L] the tokens
    table: torch.Tensor  # [V, H] float: the target's embedding of every token
    predicted: torch.Tensor  # [N, L] the target's greedy next token (whole vocabulary)
    head: torch.Tensor  # [V', H] the draft vocabulary's head rows
    vocabulary: torch.Tensor | None
    scale: torch.Tensor  # the features' RMS
    top_logp: torch.Tensor  # [N, L, K] the target's log-probs of its K likeliest draft-vocabulary tokens
    top_idx: torch.Tensor  # [N, L, K] their rows of `head`
    seconds: float = 0.0  # the target's forward and head


def _eagle_pass(module, data: _Data, rows, inputs: torch.Tensor, train: bool) -> torch.Tensor:
    """Predicted features of positions 1..L-1 from (input features 0..L-2, embeddings of tokens 1..L-1)."""
    n = inputs.shape[1]
    positions = torch.arange(n)[None].expand(len(rows), n)
    if train:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * NOISE * data.scale
    return module(data.table[data.ids[rows, 1 : n + 1]], inputs, positions)


def _loss(module, data: _Data, rows: list[int], cfg: FitConfig, train: bool) -> torch.Tensor:
    feats = data.feats[rows]
    if cfg.kind == "eagle":
        pred = _eagle_pass(module, data, rows, feats[:, :-1], train)
        loss = _kl(pred @ data.head.T, data.top_logp[rows, 1:], data.top_idx[rows, 1:])
        loss = loss + F.smooth_l1_loss(pred / data.scale, feats[:, 1:] / data.scale)
        if cfg.unroll and train:
            # Step two: position t reads its own prediction of feature t (made at t-1) and token t+1.
            pred2 = _eagle_pass(module, data, rows, torch.cat([feats[:, :1], pred[:, :-1]], 1), False)
            loss = loss + _kl(pred2[:, 1:] @ data.head.T, data.top_logp[rows, 2:], data.top_idx[rows, 2:])
        return loss
    out = module(feats)  # [K, B, L, H]
    loss = feats.new_zeros(())
    for k in range(out.shape[0]):
        shift = k + 1
        logits = out[k, :, :-shift] @ data.head.T
        loss = loss + MEDUSA_DECAY ** k * _kl(logits, data.top_logp[rows, shift:], data.top_idx[rows, shift:])
    return loss


@torch.no_grad()
def _evaluate(module, data: _Data, rows: slice, cfg: FitConfig) -> dict:
    """Held-out distillation loss and top-1 agreement with the target's greedy token, per draft depth (EAGLE: depth
    1 on the target's features, depth 2 on its own prediction; Medusa: head k)."""
    was = module.training
    module.eval()
    idx = list(range(rows.start, rows.stop))
    feats = data.feats[idx]
    loss = float(_loss(module, data, idx, cfg, train=False))
    agree = []

    def top1(pred: torch.Tensor, target_tokens: torch.Tensor) -> float:
        tok = (pred @ data.head.T).argmax(-1)
        if data.vocabulary is not None:
            tok = data.vocabulary[tok]
        return float((tok == target_tokens).double().mean())

    if cfg.kind == "eagle":
        pred = _eagle_pass(module, data, idx, feats[:, :-1], False)
        agree.append(top1(pred, data.predicted[idx, 1:]))
        pred2 = _eagle_pass(module, data, idx, torch.cat([feats[:, :1], pred[:, :-1]], 1), False)
        agree.append(top1(pred2[:, 1:], data.predicted[idx, 2:]))
    else:
        out = module(feats)
        for k in range(out.shape[0]):
            agree.append(top1(out[k, :, : -(k + 1)], data.predicted[idx, k + 1 :]))
    module.train(was)
    return {"heldout_loss": loss, "top1_agreement": agree}


def drafter_tensors(result: FitResult) -> dict[str, torch.Tensor]:
    from quantkit.formats.drafter import VOCAB_KEY

    tensors = {k: v.detach().to(torch.bfloat16) for k, v in result.module.state_dict().items()}
    if result.vocabulary is not None:
        tensors[VOCAB_KEY] = result.vocabulary.to(torch.int64)
    return tensors


def data_fingerprint(ids: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()
