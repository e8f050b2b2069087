"""Lossless acceptance of a draft tree against the target's distributions.

Greedy (temperature 0): from the root, follow the child whose token is the target's argmax; the first node
without such a child emits the argmax. The output is the target's own greedy sequence.

Sampling: at each node the target distribution p is tested against the node's children in order. Child i
carries its proposal distribution q_i (the draft distribution it was drawn from; None for a deterministic
proposal, i.e. a point mass). Child i is accepted with probability min(1, p(x_i) / q_i(x_i)); on rejection p
becomes the residual norm(max(p - q_i, 0)). If every child is rejected a token is drawn from the last residual.
For one child this is speculative sampling (Leviathan et al., Chen et al.); for several children drawn i.i.d.
from one q, or deterministic distinct children, it is multi-draft recursive rejection (SpecInfer): in every
case the emitted token is distributed exactly as p (tested by enumeration and by a chi-square test).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def node_distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The target's next-token distribution (fp64) at temperature T > 0."""
    return torch.softmax(logits.double() / temperature, dim=-1)


def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(p - q, 0)) after rejecting `token` proposed from q (q None: a point mass at `token`)."""
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q.to(p.dtype)).clamp_(min=0.0)
    total = r.sum()
    # A zero residual means p <= q everywhere with equal mass, i.e. p == q: every proposal would have been
    # accepted, so this branch has probability zero; keep p rather than divide by zero.
    return p if total <= 0 else r / total


def accept_ratio(p: torch.Tensor, q: torch.Tensor | None, token: int) -> float:
    """Probability of accepting `token` proposed from q (None: a point mass) under the current target p."""
    q_x = 1.0 if q is None else float(q[token])
    return 1.0 if q_x <= 0 else min(1.0, float(p[token]) / q_x)


def accept_child(p: torch.Tensor, children: Sequence[tuple[int, torch.Tensor | None]],
                 uniform: Callable[[], float]) -> tuple[int | None, torch.Tensor]:
    """Test `children` [(token, q)] in order against p. Returns (index of the accepted child or None, the
    distribution left after the rejections)."""
    for i, (token, q) in enumerate(children):
        if uniform() < accept_ratio(p, q, token):
            return i, p
        p = residual(p, q, token)
    return None, p


def emitted_distribution(p: torch.Tensor, children: Sequence[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
    """The exact distribution of the token one node emits for these drawn children (accepted child, else a draw
    from the final residual): what the tests sum over every possible draw to check the rule is lossless."""
    out = torch.zeros_like(p)
    reach = 1.0  # probability that every earlier child was rejected
    for token, q in children:
        a = accept_ratio(p, q, token)
        out[token] += reach * a
        reach *= 1.0 - a
        p = residual(p, q, token)
    return out + reach * p


def accept_path(parents: Sequence[int], tokens: Sequence[int], proposals: Sequence[torch.Tensor | None],
                logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None
                ) -> tuple[list[int], int]:
    """Walk the tree. `logits` [1 + N, V]: row 0 is the target after the root (the last committed token), row
    i + 1 after node i. Returns (accepted node indices root to leaf, the token the target emits after them)."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    path: list[int] = []
    node = -1
    if temperature <= 0:
        while True:
            best = int(logits[node + 1].argmax())
            nxt = next((c for c in children.get(node, ()) if tokens[c] == best), None)
            if nxt is None:
                return path, best
            path.append(nxt)
            node = nxt

    def uniform() -> float:
        return float(torch.rand((), generator=generator, dtype=torch.float64))

    while True:
        p = node_distribution(logits[node + 1], temperature)
        kids = children.get(node, [])
        chosen, left = accept_child(p, [(tokens[c], proposals[c]) for c in kids], uniform)
        if chosen is None:
            return path, int(torch.multinomial(left, 1, generator=generator))
        node = kids[chosen]
        path.append(node)
