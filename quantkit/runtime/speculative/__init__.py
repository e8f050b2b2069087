"""Speculative decoding on the step API: draft sources, draft trees, lossless acceptance, the decode loop.

One step: a draft source proposes a tree of tokens after the committed text (a chain is a tree of one branch);
the target scores the last committed token and every node in one forward (a 4-D tree mask: each node sees the
prefix and its ancestors); acceptance walks the tree from the root and keeps a path plus one token sampled
from the target (greedy: its argmax; sampling: recursive rejection sampling, so the output distribution is the
target's exactly); the target's cache keeps only the accepted path's keys and values.
"""

from quantkit.runtime.speculative.acceptance import accept_path, node_distribution
from quantkit.runtime.speculative.decode import SpecConfig, SpecResult, speculative_generate
from quantkit.runtime.speculative.drafts import DraftSource, ModelDraft, NgramDraft, self_draft
from quantkit.runtime.speculative.trees import DraftTree, TreeSpec, parse_tree

__all__ = ["DraftSource", "DraftTree", "ModelDraft", "NgramDraft", "SpecConfig", "SpecResult", "TreeSpec",
           "accept_path", "node_distribution", "parse_tree", "self_draft", "speculative_generate"]
