"""A radix tree over full token pages: which KV pages (and Mamba snapshots) hold a prefix.

A node is one page of ``page_size`` tokens (its key) under the node of the page before it; it
names the KV page that holds those positions and may carry a Mamba snapshot id, the state of
every Mamba layer after the node's last token. A prefix can only be resumed where a snapshot
exists (Mamba state cannot be rebuilt from KV), so a lookup ends at the deepest snapshot on
the matched path. ``refs`` counts the running requests that use a node; only nodes no request
uses are evicted, leaves first, least recently used first. The tree keeps no tensors and owns
no pages: ``prefix_cache.py`` ties it to the page allocator and the snapshot pool.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    page: int
    parent: Node | None
    depth: int                                  # tokens from the root through this page
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    refs: int = 0                               # running requests using this node
    last_use: int = 0
    snapshot: int | None = None                 # Mamba snapshot id after the last token

    @property
    def is_leaf(self) -> bool:
        return not self.children


class RadixTree:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = Node((), -1, None, 0)
        self._clock = 0
        self._nodes: set[Node] = set()

    def __len__(self) -> int:
        return len(self._nodes)

    def nodes(self) -> Iterator[Node]:
        return iter(self._nodes)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _key(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.page_size:(i + 1) * self.page_size])

    def match(self, tokens: list[int], limit: int) -> list[Node]:
        """The nodes of the longest cached path of full pages of ``tokens`` whose depth is at
        most ``limit`` tokens (root excluded), marked as used now."""
        path, node, now = [], self.root, self._tick()
        for i in range(min(limit, len(tokens)) // self.page_size):
            node = node.children.get(self._key(tokens, i))
            if node is None:
                break
            node.last_use = now
            path.append(node)
        return path

    def insert(self, tokens: list[int], pages: list[int]) -> tuple[list[Node], list[int]]:
        """Make the full pages of ``tokens`` (held in ``pages``, one per page) a cached path.
        Returns the path's nodes and the indices of the pages the tree adopted (new nodes);
        where a node exists already it keeps its own page."""
        path, adopted, node, now = [], [], self.root, self._tick()
        for i in range(len(tokens) // self.page_size):
            key = self._key(tokens, i)
            child = node.children.get(key)
            if child is None:
                child = Node(key, pages[i], node, node.depth + self.page_size)
                node.children[key] = child
                self._nodes.add(child)
                adopted.append(i)
            child.last_use = now
            path.append(child)
            node = child
        return path, adopted

    @staticmethod
    def lock(nodes: list[Node]) -> None:
        for n in nodes:
            n.refs += 1

    @staticmethod
    def unlock(nodes: list[Node]) -> None:
        for n in nodes:
            if n.refs <= 0:
                raise RuntimeError("radix node unlocked more often than it was locked")
            n.refs -= 1

    def remove(self, node: Node) -> None:
        """Take an unused leaf out of the tree (its page and snapshot are the caller's)."""
        if node.children or node.refs:
            raise RuntimeError("only an unused leaf can be removed")
        del node.parent.children[node.key]
        self._nodes.discard(node)

    def unused_leaves(self) -> list[Node]:
        """Leaves no request uses (eviction candidates)."""
        return [n for n in self._nodes if n.is_leaf and n.refs == 0]
