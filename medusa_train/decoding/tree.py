"""Medusa candidate trees: choices (paths of top-k ranks) -> attention mask, positions, retrieve paths.

A tree is a set of *choices*. Each choice is a path ``[r1, r2, ..., rd]`` of top-k ranks, one per
head depth: ``[0, 1]`` means "head 1's top-1 guess, then head 2's top-2 guess". Node 0 is the root:
the base model's own next token. Nodes are numbered root first, then choices sorted by
``(depth, path)``, so every parent precedes its children and node order is breadth-first.

A tree may also carry a *lookup chain* (``lookup_depth`` nodes after the heads' nodes): the root's
last child, then a chain below it, filled each step with what followed the context's last tokens
earlier in the text (``decoding.lookup``). Its tokens change every step, its shape does not, so the
mask and positions stay precomputed. A node is either a head's guess (``node_heads``/``node_ranks``)
or a lookup token (``node_lookup``); ``depth`` counts the heads a tree uses, ``tree_depth`` the
deepest node of either kind.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_train.config.paths import TREE_DIR
from medusa_train.model.walk import truncated_choices

#: the suffix sizes a lookup chain matches unless its tree says otherwise: (shortest, longest)
DEFAULT_LOOKUP_NGRAM = (1, 3)


@dataclass(frozen=True)
class _Node:
    path: tuple[int, ...]
    parent: int


class TokenTree:
    """A validated candidate tree with the buffers the decoder needs, built once.

    Args:
        choices: Paths of top-k ranks (see the module docstring). The root is implicit.
        num_heads: When given, a path deeper than this is an error.
        top_k: When given, a rank outside ``[0, top_k)`` is an error.
        lookup_depth: Nodes in the lookup chain (0: none).
        lookup_ngram: ``(shortest, longest)`` suffix of the text that the chain's lookup matches
            (``decoding.lookup.LookupChain``; the longest is tried first).

    Attributes:
        choices: The paths as tuples, in node order (node ``i + 1`` is ``choices[i]``).
        listed_choices: The paths in the order they were given (built-in trees list the most
            likely first; ``truncated`` keeps a prefix of this order).
        num_nodes: ``len(choices) + 1 + lookup_depth``.
        num_head_nodes: ``len(choices) + 1``: the root and the heads' nodes, numbered first.
        depth: Deepest path length = the number of heads the tree uses.
        lookup_depth: Nodes in the lookup chain: nodes ``num_head_nodes + j``, chain index j, at depth j + 1.
        lookup_ngram: ``(min, max)`` n-gram sizes the chain's lookup matches.
        tree_depth: The deepest node of either kind: ``max(depth, lookup_depth)``.
        heads_tree: The tree without its lookup chain (itself when it has none): what a draft fills.
        parents: (num_nodes,) long, the parent node of each node; -1 for the root.
        children: Per node, its child nodes in rank order (the root's lookup child last).
        visibility: (num_nodes, num_nodes) bool; ``[i, j]`` is True when node i may attend to node j
            (j is i or one of its ancestors).
        position_offsets: (num_nodes,) long, the depth of each node (root 0); added to the cache length.
        node_heads: (num_nodes,) long, the head (0-based) whose guess fills the node; -1 for the root.
        node_ranks: (num_nodes,) long, the top-k rank of that guess; -1 for the root.
        node_lookup: (num_nodes,) long, the lookup chain index of a lookup node; -1 for every other.
        head_top_k: Per head, how many top-k guesses the tree reads from it.
        retrieve_paths: (num_leaves, tree_depth + 1) long, the node indices from the root to each leaf,
            padded with -1.
        ancestors: (num_nodes, tree_depth + 1) long, ``[i, d]`` the node on i's path at depth d (i itself
            at its own depth), -1 below it.
        levels: Per head d, ``(parents, children, rows, ranks)`` long tensors: the depth-d nodes that
            have children, the depth-(d + 1) nodes, each child's parent as a row of ``parents`` and
            its rank. The decoder asks head d about these parents' paths and fills the children from
            those rows.
    """

    def __init__(self, choices: Iterable[Sequence[int]], num_heads: int | None = None, top_k: int | None = None,
                 lookup_depth: int = 0, lookup_ngram: Sequence[int] = DEFAULT_LOOKUP_NGRAM):
        paths = _validate(choices, num_heads, top_k)
        if isinstance(lookup_depth, bool) or not isinstance(lookup_depth, int) or lookup_depth < 0:
            raise ValueError(f"lookup_depth={lookup_depth!r}: must be an integer >= 0 (0: no lookup chain)")
        lookup_ngram = tuple(lookup_ngram)
        if (len(lookup_ngram) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in lookup_ngram)
                or not 1 <= lookup_ngram[0] <= lookup_ngram[1]):
            raise ValueError(f"lookup_ngram={list(lookup_ngram)}: must be [shortest, longest] suffix sizes, "
                             "1 <= shortest <= longest")
        self.lookup_ngram: tuple[int, int] = lookup_ngram
        self.listed_choices: list[tuple[int, ...]] = paths
        self.choices: list[tuple[int, ...]] = sorted(paths, key=lambda p: (len(p), p))
        index = {(): 0} | {p: i + 1 for i, p in enumerate(self.choices)}
        nodes = [_Node((), -1)] + [_Node(p, index[p[:-1]]) for p in self.choices]
        self.num_head_nodes = len(nodes)
        self.lookup_depth = lookup_depth
        lookup = range(self.num_head_nodes, self.num_head_nodes + lookup_depth)  # the chain's nodes
        n = self.num_head_nodes + lookup_depth
        self.num_nodes = n
        self.depth = max((len(p) for p in self.choices), default=0)
        self.tree_depth = max(self.depth, lookup_depth)
        # each node's root-to-node list of nodes: a head node's from its path, a lookup node's down the chain
        lineage = [[index[node.path[:d]] for d in range(len(node.path) + 1)] for node in nodes]
        lineage += [[0, *lookup[: j + 1]] for j in range(lookup_depth)]
        self.parents = torch.tensor([line[-2] if len(line) > 1 else -1 for line in lineage], dtype=torch.long)
        self.children: list[list[int]] = [[] for _ in range(n)]
        for i, node in enumerate(nodes[1:], start=1):
            self.children[node.parent].append(i)
        for kids in self.children:
            kids.sort(key=lambda c: nodes[c].path[-1])
        for i in lookup:
            self.children[int(self.parents[i])].append(i)

        self.visibility = torch.zeros(n, n, dtype=torch.bool)
        for i, line in enumerate(lineage):
            self.visibility[i, line] = True
        self.position_offsets = torch.tensor([len(line) - 1 for line in lineage], dtype=torch.long)
        self.node_heads = torch.tensor([len(node.path) - 1 for node in nodes] + [-1] * lookup_depth, dtype=torch.long)
        self.node_ranks = torch.tensor([node.path[-1] if node.path else -1 for node in nodes] + [-1] * lookup_depth,
                                       dtype=torch.long)
        self.node_lookup = torch.tensor([-1] * len(nodes) + list(range(lookup_depth)), dtype=torch.long)
        self.head_top_k = [1 + max(p[-1] for p in self.choices if len(p) == d + 1) for d in range(self.depth)]

        self.ancestors = torch.full((n, self.tree_depth + 1), -1, dtype=torch.long)
        for i, line in enumerate(lineage):
            self.ancestors[i, : len(line)] = torch.tensor(line)
        self.heads_tree = self if not lookup_depth else TokenTree(self.listed_choices)
        self.levels: list[tuple[torch.Tensor, ...]] = []
        self._on_device: dict[str, tuple] = {}  # see path_buffers
        for d in range(self.depth):
            kids = [i for i, node in enumerate(nodes) if len(node.path) == d + 1]
            parents = sorted({nodes[i].parent for i in kids})
            row = {p: r for r, p in enumerate(parents)}
            self.levels.append(tuple(torch.tensor(v, dtype=torch.long) for v in (
                parents, kids, [row[nodes[i].parent] for i in kids], [nodes[i].path[-1] for i in kids])))

        leaves = [i for i in range(n) if not self.children[i]]
        self.retrieve_paths = torch.full((len(leaves), self.tree_depth + 1), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            self.retrieve_paths[row, : len(lineage[leaf])] = torch.tensor(lineage[leaf])

    # ----------------------------------------------------------------------------- buffers
    def attention_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The additive tree mask (num_nodes, num_nodes): 0 where visible, ``finfo(dtype).min`` elsewhere."""
        mask = torch.zeros(self.num_nodes, self.num_nodes, dtype=dtype)
        return mask.masked_fill_(~self.visibility, torch.finfo(dtype).min)

    def path_buffers(self, device: torch.device) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """``(ancestors, levels)`` on ``device``, copied there once: the decoder reads them every step."""
        key = str(torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = (self.ancestors.to(device), [tuple(t.to(device) for t in lvl) for lvl in self.levels])
        return self._on_device[key]

    def node_paths(self) -> list[tuple[int, ...]]:
        """The path of every head node, root (``()``) first (the lookup chain's nodes follow them)."""
        return [(), *self.choices]

    # ----------------------------------------------------------------------------- checks
    def check_num_heads(self, num_heads: int) -> None:
        """Raise ``ValueError`` naming the first path that needs more heads than ``num_heads``."""
        for path in self.choices:
            if len(path) > num_heads:
                raise ValueError(
                    f"tree path {list(path)} needs {len(path)} heads but the model has {num_heads}; "
                    f"use a tree of depth <= {num_heads} (e.g. tree.truncated(max_depth={num_heads}))")

    # ----------------------------------------------------------------------------- derived trees
    def truncated(self, max_nodes: int | None = None, max_depth: int | None = None) -> TokenTree:
        """A sub-tree of at most ``max_nodes`` nodes (root included) and paths no deeper than ``max_depth``.

        Paths are taken in their listed order (most likely first for the built-in trees); a path
        whose prefix is not yet in brings that prefix in first, so the result is always a valid tree.
        A lookup chain is kept whole and counts in ``max_nodes``.
        """
        if max_nodes is not None and max_nodes < 1 + self.lookup_depth:
            raise ValueError(f"max_nodes={max_nodes}: must be >= {1 + self.lookup_depth} (the root"
                             + (f" and the {self.lookup_depth} lookup nodes)" if self.lookup_depth else ")"))
        limit = math.inf if max_nodes is None else max_nodes - 1 - self.lookup_depth
        kept = truncated_choices(self.listed_choices, limit, max_depth)
        return TokenTree(kept, lookup_depth=self.lookup_depth, lookup_ngram=self.lookup_ngram)

    def with_lookup(self, lookup_depth: int, lookup_ngram: Sequence[int] | None = None) -> TokenTree:
        """The same heads' nodes with a lookup chain of ``lookup_depth`` nodes (0: none)."""
        return TokenTree(self.listed_choices, lookup_depth=lookup_depth,
                          lookup_ngram=self.lookup_ngram if lookup_ngram is None else lookup_ngram)

    @classmethod
    def chain(cls, num_heads: int) -> TokenTree:
        """A single path of every head's top-1 guess: ``[[0], [0, 0], ...]`` (num_heads + 1 nodes)."""
        if num_heads < 0:
            raise ValueError(f"num_heads={num_heads}: must be >= 0")
        return cls([[0] * d for d in range(1, num_heads + 1)])

    @classmethod
    def from_name(cls, name: str, num_heads: int | None = None) -> TokenTree:
        """A built-in tree (``chain``, ``default``, any ``configs/tree/NAME.yaml``) or a YAML file path.

        Args:
            name: Tree name or path to a YAML file with a ``choices:`` list.
            num_heads: When given, ``chain`` is built for this many heads and any other tree is
                checked against it.
        """
        if name == "chain" and num_heads is not None:
            return cls.chain(num_heads)
        path = Path(name).expanduser()
        if path.suffix not in (".yaml", ".yml"):
            path = TREE_DIR / f"{name}.yaml"
            if not path.is_file():
                known = sorted(p.stem for p in TREE_DIR.glob("*.yaml"))
                raise ValueError(f"tree={name}: unknown tree; built-in trees are {known}, or pass a YAML file path")
        elif not path.is_file():
            raise FileNotFoundError(f"tree={name}: no such file")
        return cls(load_choices(path), num_heads=num_heads, **load_lookup(path))

    # ----------------------------------------------------------------------------- misc
    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        lookup = f", lookup_depth={self.lookup_depth}, lookup_ngram={list(self.lookup_ngram)}" if self.lookup_depth else ""
        return f"TokenTree(num_nodes={self.num_nodes}, depth={self.depth}{lookup}, leaves={len(self.retrieve_paths)})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TokenTree) and self.choices == other.choices
                and self.lookup_depth == other.lookup_depth
                and (not self.lookup_depth or self.lookup_ngram == other.lookup_ngram))

    __hash__ = None  # mutable tensors inside; equality is by choices and lookup chain


def _read_tree_file(path: str | Path) -> dict:
    import yaml  # a hydra-core dependency

    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or "choices" not in data:
        raise ValueError(f"{path}: expected a mapping with a 'choices:' list of paths")
    return data


def load_choices(path: str | Path) -> list[list[int]]:
    """Read ``choices:`` from a tree YAML file."""
    return _read_tree_file(path)["choices"]


def load_lookup(path: str | Path) -> dict:
    """``lookup_depth`` (0 when absent) and ``lookup_ngram`` (the default when absent) of a tree YAML file."""
    return _lookup_keys(_read_tree_file(path))


def _lookup_keys(spec) -> dict:
    ngram = spec.get("lookup_ngram")
    return {"lookup_depth": spec.get("lookup_depth") or 0,
            "lookup_ngram": DEFAULT_LOOKUP_NGRAM if ngram is None else tuple(ngram)}


def tree_from_config(spec, num_heads: int | None = None) -> TokenTree:
    """Build a tree from what a config holds: a ``TokenTree``, a name/path, a list of choices, or a
    mapping with ``choices`` (and optionally ``lookup_depth``: a ``configs/tree/*.yaml`` group) or ``name``.

    Args:
        spec: The tree specification.
        num_heads: Checked against the tree (and the size of ``chain``).
    """
    if isinstance(spec, TokenTree):
        tree = spec
    elif isinstance(spec, str | Path):
        return TokenTree.from_name(str(spec), num_heads=num_heads)
    elif hasattr(spec, "keys"):
        if spec.get("choices") is not None:
            tree = TokenTree(list(spec["choices"]), **_lookup_keys(spec))
        elif spec.get("name"):
            return TokenTree.from_name(str(spec["name"]), num_heads=num_heads)
        else:
            raise ValueError("tree: expected 'choices' or 'name'")
    else:
        tree = TokenTree(list(spec))
    if num_heads is not None:
        tree.check_num_heads(num_heads)
    return tree


def _validate(choices: Iterable[Sequence[int]], num_heads: int | None, top_k: int | None) -> list[tuple[int, ...]]:
    if isinstance(choices, str | bytes) or not isinstance(choices, Iterable):
        raise ValueError(f"tree choices must be a list of paths (lists of ints), got {choices!r}")
    paths: list[tuple[int, ...]] = []
    for raw in choices:
        if isinstance(raw, str | bytes) or not isinstance(raw, Iterable):
            raise ValueError(f"tree path {raw!r}: must be a list of top-k ranks")
        raw = list(raw)
        if not raw:
            raise ValueError("tree path []: the root is implicit; every path needs at least one rank")
        if not all(isinstance(k, int) and not isinstance(k, bool) for k in raw):
            raise ValueError(f"tree path {raw}: ranks must be integers")
        if any(k < 0 for k in raw):
            raise ValueError(f"tree path {raw}: ranks must be >= 0")
        if top_k is not None and any(k >= top_k for k in raw):
            raise ValueError(f"tree path {raw}: rank {max(raw)} needs top_k > {max(raw)} but top_k={top_k}")
        if num_heads is not None and len(raw) > num_heads:
            raise ValueError(f"tree path {raw} needs {len(raw)} heads but num_heads={num_heads}")
        paths.append(tuple(raw))
    seen: set[tuple[int, ...]] = set()
    for p in paths:
        if p in seen:
            raise ValueError(f"tree path {list(p)} appears more than once")
        seen.add(p)
    for p in paths:
        for d in range(1, len(p)):
            if p[:d] not in seen:
                raise ValueError(f"tree path {list(p)}: its prefix {list(p[:d])} is missing")
    return paths


def fill_step_mask(mask: torch.Tensor, tree_mask: torch.Tensor, past_len: int) -> torch.Tensor:
    """A step's additive mask, (nodes, keys), written into ``mask`` and returned: the ``past_len`` cached tokens
    visible to every node, the nodes' own tree mask, and nothing after (a static cache's slots past the text,
    which hold stale nodes or nothing)."""
    nodes = tree_mask.shape[0]
    mask[:, :past_len] = 0
    mask[:, past_len:past_len + nodes] = tree_mask
    mask[:, past_len + nodes:] = torch.finfo(mask.dtype).min
    return mask
