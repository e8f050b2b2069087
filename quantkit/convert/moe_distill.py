"""Distillation of a MoEfied model: router and experts fitted to the dense model at a normal router temperature.

Plain MoEfication (convert/moefy.py) keeps the dense function exactly at top-k = E only by writing the router
at a temperature so low that every combine weight is a constant; at the configured top-k such a model is far
from the dense one (a few nats of KL on SmolLM2 at 16x top-4) and its routing margins sit at bf16 rounding
level, so a bf16 and an fp32 run of the same checkpoint route differently. A trained MoE has neither property.

Here the split's router starts from its least-squares fit scaled to a unit logit spread per token, the layout
normalises the top-k weights (each routed down_proj scaled by k, so equal weights give the sum of the selected
experts), and two fits follow:

1. Local, per layer: router and experts minimise ||MoE(x) - MLP(x)||^2 / ||MLP(x)||^2 on the dense model's
   own MLP inputs. The router learns through the combine weights of the experts it selects.
2. End to end: every layer's router and experts together minimise KL(dense || MoE) of the next-token
   distributions, with the dense model as teacher on the same blocks; attention, norms and embeddings stay
   frozen (they are the dense model's). This corrects what the local fits compound across layers. It reads
   every calibration block (the local fits only the first `local_samples`, whose activations are held for all
   layers at once): with few blocks the end-to-end fit overfits (SmolLM2, 112 training blocks, 100 steps of 4:
   train KL 0.36, held-out 0.68).

The student computes all experts at once, masked by the combine weights: the same cost as the dense MLP and the
same function as the layout's sparse dispatch (the routing is the runtime's `route`, the family's exact rule).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.models.moe import RouterSpec


@dataclass(frozen=True)
class DistillOptions:
    local_steps: int = 150  # per layer
    local_samples: int = 64  # calibration blocks whose activations the split and the local fits use (memory)
    heldout_samples: int = 16  # end to end: at most this many of the held-out last eighth are scored
    steps: int = 120  # end to end
    batch_tokens: int = 2048  # local fits
    batch_size: int = 4  # end to end: sequences per step
    lr_local: float = 2e-3
    lr: float = 1e-3
    logit_std: float = 1.0  # router logits' initial spread over experts (mean per-token std)
    bf16: bool = True  # matmuls under bf16 autocast; weights, optimiser and losses stay fp32
    seed: int = 0

    def check(self) -> None:
        from quantkit.errors import InputError

        if self.local_steps < 0 or self.steps < 0:
            raise InputError("distillation steps must be 0 or more")
        if self.local_samples < 1 or self.heldout_samples < 1:
            raise InputError("distillation local_samples and heldout_samples must be at least 1")
        if self.logit_std <= 0:
            raise InputError("the router's initial logit spread must be > 0")


class StudentMoE(nn.Module):
    """One MoE layer as trainable tensors: router [E, H], experts stacked [E*m, H] / [H, E*m], optional shared
    expert (and Qwen2-MoE's sigmoid gate on it). Forward = the layout's routing, all experts masked."""

    def __init__(self, spec: RouterSpec, act, split, shared_gate: torch.Tensor | None = None):
        """`split`: a convert.moefy.LayerMoE (router [E, H], gate/up [E, m, H], down [E, H, m], shared
        gate/up/down or None) whose tensors are the start; `shared_gate` [1, H]: Qwen2-MoE's gate on the shared
        expert."""
        super().__init__()
        self.spec = spec
        self.act = act
        e, m, h = split.gate.shape
        self.m = m
        self.router = nn.Parameter(split.router.float().clone())
        self.gate = nn.Parameter(split.gate.reshape(e * m, h).float().clone())
        self.up = nn.Parameter(split.up.reshape(e * m, h).float().clone())
        self.down = nn.Parameter(split.down.permute(1, 0, 2).reshape(h, e * m).float().clone())
        self.shared = None
        if split.shared_gate is not None:
            self.shared = nn.ParameterList([nn.Parameter(t.float().clone())
                                            for t in (split.shared_gate, split.shared_up, split.shared_down)])
        self.shared_gate = None if shared_gate is None else nn.Parameter(shared_gate.float().clone())
        # DeepSeek's selection bias: zero, as written (balancing it is eval's business, not the fit's).
        self.register_buffer("bias", torch.zeros(spec.num_experts) if spec.selection_bias else None)

    def routing(self, x: torch.Tensor):
        from quantkit.runtime.moe import route

        return route(self.spec, F.linear(x.float(), self.router), self.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        r = self.routing(x)
        dense_w = torch.zeros(x.shape[0], self.spec.num_experts, device=x.device).scatter(1, r.selected,
                                                                                         r.weights.float())
        h = self.act(F.linear(x, self.gate)) * F.linear(x, self.up)
        h = (h.view(x.shape[0], self.spec.num_experts, self.m) * dense_w[..., None].to(h.dtype)).flatten(1)
        out = F.linear(h, self.down)
        if self.shared is not None:
            g, u, d = self.shared
            s = F.linear(self.act(F.linear(x, g)) * F.linear(x, u), d)
            if self.shared_gate is not None:
                s = torch.sigmoid(F.linear(x, self.shared_gate)) * s
            out = out + s
        return out.reshape(shape)

    def tensors(self) -> dict:
        """(router, gate [E, m, H], up, down [E, H, m], shared (g, u, d) or None, shared gate or None)."""
        e, h = self.spec.num_experts, self.router.shape[1]
        d = self.down.detach().reshape(h, e, self.m).permute(1, 0, 2)
        return {"router": self.router.detach(), "gate": self.gate.detach().reshape(e, self.m, h),
                "up": self.up.detach().reshape(e, self.m, h), "down": d.contiguous(),
                "shared": None if self.shared is None else tuple(p.detach() for p in self.shared),
                "shared_gate": None if self.shared_gate is None else self.shared_gate.detach()}


def unit_spread(router: torch.Tensor, x: torch.Tensor, std: float) -> torch.Tensor:
    """`router` [E, H] scaled so that its logits on x [T, H] have a mean per-token spread (std over experts)
    of `std`: the softmax then neither ties (margins at rounding level) nor saturates."""
    spread = (x.float() @ router.float().T).std(dim=1).mean().item()
    return router * (std / spread) if spread > 0 else router


def _sig(v: float) -> float:
    return float(f"{v:.6g}")


def _autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def fit_local(student: StudentMoE, x: torch.Tensor, y: torch.Tensor, opts: DistillOptions,
              generator: torch.Generator) -> dict:
    """Fit one layer to its dense MLP: x [T, H] inputs, y [T, H] dense outputs. Returns the relative error
    on the held-out last eighth before and after."""
    cut = max(1, x.shape[0] * 7 // 8)
    xt, yt, xh, yh = x[:cut], y[:cut], x[cut:], y[cut:]

    def heldout() -> float:
        with torch.no_grad(), _autocast(opts.bf16):
            out = student(xh).float()
        return float((out - yh).square().sum() / yh.square().sum().clamp_min(1e-30))

    before = heldout()
    if opts.local_steps:
        optim = torch.optim.Adam(student.parameters(), lr=opts.lr_local)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, opts.local_steps)
        n = min(opts.batch_tokens, cut)
        for _ in range(opts.local_steps):
            idx = torch.randint(0, cut, (n,), generator=generator)
            with _autocast(opts.bf16):
                out = student(xt[idx]).float()
            target = yt[idx]
            loss = (out - target).square().sum() / target.square().sum().clamp_min(1e-30)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
    return {"relative_error_before": _sig(before), "relative_error_after": _sig(heldout())}


class Switch(nn.Module):
    """A decoder layer's MLP slot that runs the dense MLP (teacher) or the student MoE."""

    def __init__(self, dense: nn.Module, student: StudentMoE):
        super().__init__()
        self.dense, self.student = dense, student
        self.use_student = True

    def forward(self, x):
        return self.student(x) if self.use_student else self.dense(x)


def _kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    lt = torch.log_softmax(teacher_logits.float(), -1)
    ls = torch.log_softmax(student_logits.float(), -1)
    return (lt.exp() * (lt - ls)).sum(-1).mean()


def fit_end_to_end(model, switches: list[Switch], ids: torch.Tensor, opts: DistillOptions,
                   generator: torch.Generator, progress=None) -> list[dict]:
    """Train every student together on KL(dense || MoE) over blocks ids [N, L]; the last eighth of the blocks
    is held out and scored every quarter of the run."""
    cut = max(1, ids.shape[0] * 7 // 8)
    train, held = ids[:cut], (ids[cut:] if ids.shape[0] > cut else ids[:1])[:opts.heldout_samples]
    params = [p for s in switches for p in s.student.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)

    def set_mode(student: bool):
        for s in switches:
            s.use_student = student

    def heldout() -> float:
        total = 0.0
        with torch.no_grad(), _autocast(opts.bf16):
            for i in range(0, held.shape[0], opts.batch_size):
                b = held[i:i + opts.batch_size]
                set_mode(False)
                t = model(input_ids=b, use_cache=False).logits
                set_mode(True)
                s = model(input_ids=b, use_cache=False).logits
                total += float(_kl(t, s)) * b.shape[0]
        return total / held.shape[0]

    history = [{"step": 0, "heldout_kl": _sig(heldout())}]
    if not opts.steps:
        return history
    optim = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, opts.steps)
    every = max(1, opts.steps // 4)
    for step in range(1, opts.steps + 1):
        idx = torch.randint(0, cut, (min(opts.batch_size, cut),), generator=generator)
        b = train[idx]
        with torch.no_grad(), _autocast(opts.bf16):
            set_mode(False)
            t = model(input_ids=b, use_cache=False).logits
        set_mode(True)
        with _autocast(opts.bf16):
            s = model(input_ids=b, use_cache=False).logits
        loss = _kl(t, s)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        sched.step()
        if progress:
            progress(step, float(loss.detach()))
        if step % every == 0 or step == opts.steps:
            history.append({"step": step, "train_kl": _sig(float(loss.detach())), "heldout_kl": _sig(heldout())})
    return history


def student_from_split(split, spec: RouterSpec, act, x: torch.Tensor, opts: DistillOptions,
                       shared_gate: bool) -> StudentMoE:
    """The starting student of one MoEfied layer (`split`: convert.moefy.LayerMoE): the fitted router at a unit
    logit spread on x, each routed down_proj times k (normalised top-k weights average 1/k), the shared expert
    as it is, and, for Qwen2-MoE (`shared_gate`), a zero sigmoid gate on it with its down_proj doubled."""
    start = dataclasses.replace(split, router=unit_spread(split.router_fit, x, opts.logit_std),
                                down=split.down * spec.top_k)
    gate = None
    if split.shared_gate is not None and shared_gate:
        start.shared_down = split.shared_down * 2.0
        gate = torch.zeros(1, x.shape[1])
    return StudentMoE(spec, act, start, gate)
