"""Prefix KV cache of the CPU engine: a block-granular radix tree with LRU eviction.

A sequence is cut into blocks of ``block_size`` token ids. Block j of a sequence is keyed by
(id of the node holding block j-1, the block's token ids), so a node stands for one exact token
prefix — there are no hash collisions to worry about, and two prompts share nodes exactly as far
as their token ids agree, block by block (a partial last block is never cached). Each node keeps
the block's keys and values for every layer, computed under one weight version; a weight update
flushes the whole cache.

Eviction is least-recently-used under a token budget, leaves first: every lookup or insert touches
the nodes of the path from the deepest one back up to the root, so a parent is always more recent
than its children and the least recently used node is a leaf. The cache copies KV in and out of a
request's slot, so no node is ever pinned by a running request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

ROOT_ID = 0

# KV of positions [start, end) of the sequence being inserted.
KvReader = Callable[[int, int], torch.Tensor]


@dataclass
class _Node:
    node_id: int
    parent_id: int
    tokens: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2, heads, block_size, head_dim]
    children: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class PrefixMatch:
    """How much of a sequence the cache holds: ``tokens`` ids at the start, with their KV."""

    tokens: int
    kv_blocks: list[torch.Tensor]


class PrefixCache:
    def __init__(self, block_size: int, token_budget: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if token_budget < 0:
            raise ValueError(f"token_budget must be >= 0, got {token_budget}")
        self.block_size = block_size
        self.token_budget = token_budget
        self._nodes: OrderedDict[int, _Node] = OrderedDict()  # least recently used first
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._root_children: set[int] = set()
        self._next_id = ROOT_ID + 1
        self.evicted_blocks = 0

    @property
    def cached_tokens(self) -> int:
        return len(self._nodes) * self.block_size

    @property
    def num_blocks(self) -> int:
        return len(self._nodes)

    def _blocks(self, token_ids: list[int], max_tokens: int) -> list[tuple[int, ...]]:
        usable = min(len(token_ids), max_tokens) // self.block_size * self.block_size
        return [
            tuple(token_ids[start : start + self.block_size]) for start in range(0, usable, self.block_size)
        ]

    def _walk(self, token_ids: list[int], max_tokens: int) -> list[_Node]:
        path: list[_Node] = []
        parent_id = ROOT_ID
        for block in self._blocks(token_ids, max_tokens):
            node_id = self._by_key.get((parent_id, block))
            if node_id is None:
                break
            path.append(self._nodes[node_id])
            parent_id = node_id
        return path

    def _touch(self, path: list[_Node]) -> None:
        # Deepest first, so that every ancestor ends up more recent than its descendants.
        for node in reversed(path):
            self._nodes.move_to_end(node.node_id)

    def match(self, token_ids: list[int], max_tokens: int) -> PrefixMatch:
        """The longest cached prefix of ``token_ids`` no longer than ``max_tokens``."""
        path = self._walk(token_ids, max_tokens)
        self._touch(path)
        return PrefixMatch(tokens=len(path) * self.block_size, kv_blocks=[node.kv for node in path])

    def insert(self, token_ids: list[int], kv_of_span: KvReader) -> int:
        """Cache every full block of ``token_ids`` not cached yet; ``kv_of_span(start, end)``
        returns the KV of those positions. Returns the number of blocks added."""
        if self.token_budget < self.block_size:
            return 0
        path: list[_Node] = []
        parent_id = ROOT_ID
        added = 0
        for index, block in enumerate(self._blocks(token_ids, len(token_ids))):
            node_id = self._by_key.get((parent_id, block))
            if node_id is None:
                start = index * self.block_size
                node = _Node(self._next_id, parent_id, block, kv_of_span(start, start + self.block_size))
                self._next_id += 1
                self._nodes[node.node_id] = node
                self._by_key[(parent_id, block)] = node.node_id
                self._children_of(parent_id).add(node.node_id)
                added += 1
                node_id = node.node_id
            path.append(self._nodes[node_id])
            parent_id = node_id
        self._touch(path)
        self._evict_over_budget()
        return added

    def _children_of(self, node_id: int) -> set[int]:
        return self._root_children if node_id == ROOT_ID else self._nodes[node_id].children

    def _evict_over_budget(self) -> None:
        while self.cached_tokens > self.token_budget:
            oldest_id = next(iter(self._nodes))
            self._remove_subtree(oldest_id)

    def _remove_subtree(self, node_id: int) -> None:
        # The oldest node is a leaf by construction; removing its subtree keeps the tree
        # consistent even if that ever stopped being true.
        node = self._nodes[node_id]
        for child_id in list(node.children):
            self._remove_subtree(child_id)
        self._children_of(node.parent_id).discard(node_id)
        del self._by_key[(node.parent_id, node.tokens)]
        del self._nodes[node_id]
        self.evicted_blocks += 1

    def flush(self) -> int:
        """Drop everything; returns the number of blocks dropped."""
        dropped = len(self._nodes)
        self._nodes.clear()
        self._by_key.clear()
        self._root_children.clear()
        return dropped
