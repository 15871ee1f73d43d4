"""The simulator's prefix cache: SGLang's RadixCache (page size 1) over the simulator's tokens, LRU eviction."""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

# A key is one request's tokens: interned strings (the simulator's tokenizer) or ints (token-id prompts).
Token = str | int


class Node:
    """One edge of the tree: the tokens on it, who holds it, and when it was last used."""

    __slots__ = ("children", "parent", "key", "lock_ref", "last_access")

    def __init__(self, parent: Node | None, key: list[Token], last_access: int) -> None:
        self.children: dict[Token, Node] = {}  # by the first token of the child's edge
        self.parent = parent
        self.key = key
        self.lock_ref = 0  # running requests whose tokens run through this node (never evicted while > 0)
        self.last_access = last_access


def _common_len(edge: list[Token], key: Sequence[Token], start: int) -> int:
    """How many leading tokens of `edge` equal key[start:]; slice compares run in C, a bisection finds a split."""
    n = min(len(edge), len(key) - start)
    if edge[:n] == key[start:start + n]:
        return n
    lo, hi = 0, n - 1  # edge[:lo] matches; edge[:hi + 1] does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if edge[lo:mid] == key[start + lo:start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixCache:
    """Token-level radix tree as SGLang's `mem_cache/radix_cache.py` keeps it (page_size 1).

    - `match_prefix(key)` returns the longest cached prefix (splitting an edge matched part way, as SGLang does).
    - `insert(key)` adds the tokens not yet in the tree and returns how many were already there.
    - `lock(node)` / `unlock(node)` count the running requests that hold a path; a held path is protected.
    - `evict(n)` frees at least n unheld tokens, least recently used leaves first (SGLang's heap over leaves).

    Cost: a match or insert walks one node per branch point, comparing edges with C-level slice compares
    (O(prompt tokens) work, a handful of Python steps); an eviction scans the leaves once (O(nodes)).
    """

    def __init__(self) -> None:
        self._clock = itertools.count(1)
        self.root = Node(None, [], 0)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0  # tokens in the tree no running request holds
        self.protected_size = 0  # tokens in the tree some running request holds
        self.evicted_total = 0

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def match_prefix(self, key: Sequence[Token]) -> tuple[int, Node]:
        """(matched tokens, the node where the match ends); refreshes the path's LRU time."""
        now = next(self._clock)
        node, i = self.root, 0
        node.last_access = now
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_len(child.key, key, i)
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + n
            if partial:
                break
        return i, node

    def insert(self, key: Sequence[Token]) -> tuple[int, Node]:
        """Add `key`; returns (tokens already cached, the node holding its last token). New tokens are unheld."""
        now = next(self._clock)
        node, i = self.root, 0
        node.last_access = now
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = Node(node, list(key[i:]), now)
                node.children[key[i]] = leaf
                self.evictable_size += len(leaf.key)
                return i, leaf
            n = _common_len(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + n
        return i, node

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child`'s edge after n tokens; returns the new upper node (it inherits the locks)."""
        upper = Node(child.parent, child.key[:n], child.last_access)
        upper.lock_ref = child.lock_ref
        child.parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unheld tokens (fewer if there are not that many); returns tokens freed."""
        if num_tokens <= 0 or not self.evictable_size:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.evicted_total += freed
        return freed

    def _leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def node_count(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count
