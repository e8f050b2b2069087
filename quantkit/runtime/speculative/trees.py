"""Draft tree shapes and how a draft grows them.

`--tree` names the shape (K = `--draft-tokens`):
- `chain`: K tokens, one after the other.
- `static:WxD`: W branches at the root (the draft's top W tokens, or W samples), each continued as a chain, D
  tokens deep in all (W * D nodes).
- `dynamic:N`: EAGLE-2: grown level by level up to depth K; at each level the W = 4 nodes of highest
  cumulative draft confidence (the product along the path of the draft's probabilities, each calibrated by the
  acceptance measured so far for draft tokens of that probability) are expanded, each with its top 4 children,
  while one of them beats the N-th best node so far; the N nodes of highest confidence form the tree
  (ancestor-closed, since confidence only falls along a path). With sampling, expanded nodes keep all their children (drawn i.i.d. from the
  draft), which the multi-draft acceptance needs, and the budget counts whole child sets.
  `dynamic:N@F`: the same with a confidence floor F: only nodes whose confidence (the chance, as measured so far,
  that the target accepts the path to them) reaches F are kept or expanded, so the tree is as deep as the draft is
  sure, down to no node at all: the step then verifies the last token alone, a plain decoding step. A weak draft
  then speculates only where it is likely right, instead of paying for a verify it will mostly lose.
- `opt:N`: OPT-Tree: the N-node shape that maximises the expected accepted length E = sum over nodes of the
  product along its path of the measured acceptance rate of (depth, rank among siblings); the rates are
  counted as decoding goes (starting from a prior), so the shape adapts to how well this draft matches this
  target. Children are the draft's top tokens in rank order.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from typing import Protocol

import torch

from quantkit.errors import InputError

DYNAMIC_WIDTH = 4  # children per expanded node and nodes expanded per level (EAGLE-2's top-k)
CONFIDENCE_BINS = 10  # draft-probability bins whose measured acceptance calibrates dynamic trees


@dataclass(frozen=True)
class TreeSpec:
    kind: str  # chain | static | dynamic | opt
    depth: int  # chain length, branch depth, or the deepest level grown
    width: int = 1  # static branches
    nodes: int = 0  # dynamic / opt node budget
    floor: float = 0.0  # dynamic: the least confidence a node needs to be drafted (0: the budget alone decides)

    @property
    def max_nodes(self) -> int:
        if self.kind == "chain":
            return self.depth
        if self.kind == "static":
            return self.width * self.depth
        return self.nodes

    def describe(self) -> str:
        return {"chain": f"chain:{self.depth}", "static": f"static:{self.width}x{self.depth}",
                "dynamic": f"dynamic:{self.nodes}" + (f"@{self.floor:g}" if self.floor else ""),
                "opt": f"opt:{self.nodes}"}[self.kind]


def parse_tree(text: str, draft_tokens: int) -> TreeSpec:
    if draft_tokens < 1:
        raise InputError(f"--draft-tokens must be at least 1, got {draft_tokens}")
    text = (text or "chain").strip().lower()
    if text == "chain":
        return TreeSpec("chain", draft_tokens)
    m = re.fullmatch(r"static:(\d+)x(\d+)", text)
    if m:
        w, d = int(m.group(1)), int(m.group(2))
        if w < 1 or d < 1:
            raise InputError(f"--tree {text}: width and depth must be at least 1")
        return TreeSpec("static", d, width=w)
    m = re.fullmatch(r"(dynamic|opt):(\d+)(?:@(\d*\.?\d+))?", text)
    if m:
        n = int(m.group(2))
        if n < 1:
            raise InputError(f"--tree {text}: the node budget must be at least 1")
        floor = float(m.group(3) or 0.0)
        if m.group(3) is not None and (m.group(1) != "dynamic" or not 0.0 < floor < 1.0):
            raise InputError(f"--tree {text}: a confidence floor (@F) is for dynamic trees, with 0 < F < 1")
        return TreeSpec(m.group(1), draft_tokens, nodes=n, floor=floor)
    raise InputError(f"unknown --tree {text!r}; use chain, static:WIDTHxDEPTH, dynamic:NODES[@FLOOR] or opt:NODES")


@dataclass
class DraftTree:
    """Nodes in creation order (parents before children); parent -1 = a child of the last committed token."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    proposals: list[torch.Tensor | None] = field(default_factory=list)  # q a node was drawn from; None = chosen
    depths: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # rank among its siblings (0 = first)
    probs: list[float | None] = field(default_factory=list)  # the draft's probability of the node (None: unknown)

    def add(self, token: int, parent: int, proposal: torch.Tensor | None, rank: int, prob: float | None = None) -> int:
        self.probs.append(prob)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.proposals.append(proposal)
        self.depths.append(0 if parent < 0 else self.depths[parent] + 1)
        self.ranks.append(rank)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


class Expander(Protocol):
    """What a model draft offers the tree builders: its distribution after the context, and after tree nodes."""

    def root(self) -> torch.Tensor: ...

    def expand(self, tree: DraftTree, nodes: list[int]) -> list[torch.Tensor]: ...


def _children(q: torch.Tensor, count: int, sample: bool, generator) -> list[tuple[int, torch.Tensor | None]]:
    """`count` children from the draft distribution q: i.i.d. samples (proposal q) or the top tokens (chosen)."""
    if sample:
        drawn = torch.multinomial(q, count, replacement=True, generator=generator)
        return [(int(t), q) for t in drawn]
    return [(int(t), None) for t in torch.topk(q, min(count, q.shape[-1])).indices]


def build_chain(exp: Expander, depth: int, sample: bool, generator) -> DraftTree:
    return build_static(exp, 1, depth, sample, generator)


def build_static(exp: Expander, width: int, depth: int, sample: bool, generator) -> DraftTree:
    tree = DraftTree()
    leaves = []
    for rank, (tok, q) in enumerate(_children(exp.root(), width, sample, generator)):
        leaves.append(tree.add(tok, -1, q, rank))
    for _ in range(depth - 1):
        nxt = []
        for leaf, q in zip(leaves, exp.expand(tree, leaves)):
            (tok, prop), = _children(q, 1, sample, generator)
            nxt.append(tree.add(tok, leaf, prop, 0))
        leaves = nxt
    return tree


def build_dynamic(exp: Expander, budget: int, depth: int, sample: bool, generator,
                  rates: "AcceptanceRates | None" = None, floor: float = 0.0) -> DraftTree:
    """EAGLE-2 style: expand the most confident nodes level by level; keep the `budget` most confident. A
    node's confidence is the product along its path of the draft's probabilities, each mapped through the
    acceptance measured so far for draft tokens of that probability (`AcceptanceRates.calibrated`): a draft
    that is sure and wrong, or unsure and right, then grows the tree its acceptance deserves. Nodes below
    `floor` are neither expanded nor kept (with sampling: a child set is kept whole when its parent is sure
    enough, and the root's when the draft's top token is: a decision on q itself, never on the draws)."""
    tree, conf = DraftTree(), []
    accepted = rates.calibrated if rates is not None else (lambda p: p)  # a draft probability's acceptance

    def add_children(parent: int, q: torch.Tensor, parent_conf: float) -> list[int]:
        out = []
        for rank, (tok, prop) in enumerate(_children(q, DYNAMIC_WIDTH, sample, generator)):
            p = float(q[tok])
            out.append(tree.add(tok, parent, prop, rank, prob=p))
            conf.append(parent_conf * accepted(p))
        return out

    root = exp.root()
    if floor > 0:
        # Whether to draft at all is decided on the draft's distribution, not on what was drawn from it: a sampled
        # child set kept only when its draws are likely would no longer be drawn from the q the acceptance uses.
        if accepted(float(root.max())) < floor:
            return DraftTree()  # not even the draft's top token is likely enough: verify the last token alone
    level = add_children(-1, root, 1.0)
    for _ in range(depth - 1):
        expand = heapq.nlargest(DYNAMIC_WIDTH, level, key=lambda n: (conf[n], -n))
        expand = [n for n in expand if conf[n] >= floor]
        if sample:  # whole child sets: stop before the budget would split one
            expand = expand[: max(0, (budget - len(tree)) // DYNAMIC_WIDTH)]
        elif len(tree) >= budget:
            # Confidence only falls along a path: once no node to expand beats the budget-th best node, no
            # deeper node can enter the tree.
            cutoff = heapq.nlargest(budget, conf)[-1]
            expand = [n for n in expand if conf[n] > cutoff]
        if not expand:
            break
        level = []
        for node, q in zip(expand, exp.expand(tree, expand)):
            level += add_children(node, q, conf[node])
    if sample:
        keep = sorted(range(min(len(tree), budget)))
    else:
        ranked = [n for n in sorted(range(len(tree)), key=lambda n: (-conf[n], n)) if conf[n] >= floor]
        keep = sorted(ranked[:budget])
    return _subtree(tree, keep)


def build_tree(exp: Expander, spec: TreeSpec, sample: bool, generator,
               rates: "AcceptanceRates | None" = None) -> DraftTree:
    """The tree `spec` names, grown by `exp`."""
    if spec.kind in ("chain", "static"):
        return build_static(exp, 1 if spec.kind == "chain" else spec.width, spec.depth, sample, generator)
    if spec.kind == "dynamic":
        return build_dynamic(exp, spec.nodes, spec.depth, sample, generator, rates, spec.floor)
    return build_opt(exp, opt_shape(rates or AcceptanceRates(), spec.nodes, spec.depth), sample, generator)


def _subtree(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The nodes `keep` (ancestor-closed, in creation order), renumbered."""
    index = {old: new for new, old in enumerate(keep)}
    out = DraftTree()
    for old in keep:
        parent = tree.parents[old]
        out.add(tree.tokens[old], -1 if parent < 0 else index[parent], tree.proposals[old], tree.ranks[old],
                tree.probs[old])
    return out


@dataclass
class AcceptanceRates:
    """Measured acceptance rate per (depth, sibling rank), for OPT-Tree shapes. Prior: rank r at any depth is
    accepted with 0.6 / (r + 1), counted as two observations so measurements take over quickly."""

    seen: dict[tuple[int, int], float] = field(default_factory=dict)
    hits: dict[tuple[int, int], float] = field(default_factory=dict)
    # Acceptance by the draft's own probability of the node, in CONFIDENCE_BINS equal bins (dynamic trees).
    prob_seen: list[float] = field(default_factory=lambda: [0.0] * CONFIDENCE_BINS)
    prob_hits: list[float] = field(default_factory=lambda: [0.0] * CONFIDENCE_BINS)

    def rate(self, depth: int, rank: int) -> float:
        prior = 0.6 / (rank + 1)
        return (self.hits.get((depth, rank), 0.0) + 2 * prior) / (self.seen.get((depth, rank), 0.0) + 2)

    def calibrated(self, p: float) -> float:
        """The measured acceptance of draft tokens whose draft probability was near p (prior: p itself, as
        EAGLE-2 assumes, counted as two observations)."""
        b = min(int(p * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)
        return (self.prob_hits[b] + 2 * p) / (self.prob_seen[b] + 2)

    def record(self, tree: DraftTree, path: list[int]) -> None:
        """A node counts as tried when its parent was reached (the root always is)."""
        reached = {-1, *path}
        for i in range(len(tree)):
            if tree.parents[i] in reached:
                key = (tree.depths[i], tree.ranks[i])
                self.seen[key] = self.seen.get(key, 0.0) + 1
                self.hits[key] = self.hits.get(key, 0.0) + (i in path)
                p = tree.probs[i]
                if p is not None:
                    b = min(int(p * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)
                    self.prob_seen[b] += 1
                    self.prob_hits[b] += i in path


def opt_shape(rates: AcceptanceRates, budget: int, max_depth: int, max_width: int = 8) -> list[tuple[int, int]]:
    """The `budget`-node shape maximising the expected accepted length, as (parent, rank) in creation order.

    Every node's value (the probability it is accepted) is its parent's value times rate(depth, rank); values
    fall along paths and across ranks, so taking the most valuable frontier node each time is optimal and keeps
    the shape ancestor-closed and rank-contiguous."""
    shape: list[tuple[int, int]] = []
    depth_of: list[int] = []
    frontier = [(-rates.rate(0, 0), 0, -1, 0)]  # (-value, tiebreak, parent, rank)
    tick = 1
    while frontier and len(shape) < budget:
        neg, _, parent, rank = heapq.heappop(frontier)
        node = len(shape)
        shape.append((parent, rank))
        depth = 0 if parent < 0 else depth_of[parent] + 1
        depth_of.append(depth)
        value = -neg
        if rank + 1 < max_width:  # its next sibling
            parent_value = value / rates.rate(depth, rank)
            heapq.heappush(frontier, (-parent_value * rates.rate(depth, rank + 1), tick, parent, rank + 1))
            tick += 1
        if depth + 1 < max_depth:  # its first child
            heapq.heappush(frontier, (-value * rates.rate(depth + 1, 0), tick, node, 0))
            tick += 1
    return shape


def build_opt(exp: Expander, shape: list[tuple[int, int]], sample: bool, generator) -> DraftTree:
    """Fill `shape` with the draft's top tokens (rank r = the r-th most likely), one expansion per level. The
    children are chosen, not drawn, so the acceptance treats each as a point-mass proposal (exact with sampling)."""
    tree = DraftTree()
    depth_of: list[int] = []
    for parent, _ in shape:
        depth_of.append(0 if parent < 0 else depth_of[parent] + 1)
    created: dict[int, int] = {}  # shape index -> tree node
    dists = {-1: exp.root()}
    for depth in range(max(depth_of, default=-1) + 1):
        level = [i for i, d in enumerate(depth_of) if d == depth]
        parents = sorted({created[shape[i][0]] for i in level if shape[i][0] >= 0})
        if parents:
            dists.update(zip(parents, exp.expand(tree, parents)))
        for i in sorted(level, key=lambda i: shape[i]):
            parent, rank = shape[i]
            node = -1 if parent < 0 else created[parent]
            top = torch.topk(dists[node], rank + 1).indices
            created[i] = tree.add(int(top[rank]), node, None, rank)
    return tree
