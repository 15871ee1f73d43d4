"""The prefix index: what each backend was sent, as chained hashes of fixed-size byte blocks of the prompt."""
from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

# The block unit is bytes of the prompt exactly as the client serialised it (the raw JSON of `messages`, or
# of `prompt`): the router does not tokenize, msgspec hands those bytes over without parsing them, and a
# client re-sends a conversation's earlier turns serialised the same way, so turn N+1's bytes start with
# turn N's. A block of 1024 bytes is about 256 tokens of English at SGLang's ~4 bytes a token (the simulator's
# word tokenizer: ~5.5); the router learns the ratio from the usage backends report (router.affinity).
BLOCK_BYTES = 1024
# At most this many blocks of one prompt are hashed and kept (1024 x 1 KiB: ~256k tokens): an enormous body
# costs no more than that, and what lies beyond is past any prefix worth routing on.
MAX_BLOCKS = 1024

# Kinds of prompt, a closed set (metric label values): only TEXT is hashed, the rest routes by load.
TEXT, NO_TEXT, IMAGE, TOKEN_IDS = "text", "no_text", "image", "token_ids"
KINDS = (TEXT, NO_TEXT, IMAGE, TOKEN_IDS)
_MEDIA = (b'"image_url"', b'"input_audio"', b'"video_url"', b'"audio_url"')
_TEXT_CONTENT = re.compile(rb'"(?:content|text)"\s*:\s*"[^"]')  # a non-empty string content somewhere
_IDS = re.compile(rb"\[\s*(?:\[\s*)?-?\d")  # [1, 2 ...] or [[1, 2 ...]]: token ids


def chain(raw: bytes, block: int = BLOCK_BYTES, limit: int = MAX_BLOCKS) -> list[int]:
    """The chained hash of each full block: entry i stands for bytes [0, (i+1) * block) (hash of the previous
    entry and the block), so equal entries mean equal prefixes. Python's 64-bit hash (SipHash, randomised per
    process: the index lives in one process's memory and is never shared). The partial tail is left out: it
    cannot equal a block of a longer prompt."""
    out: list[int] = []
    h = 0
    end = min(len(raw) // block, limit) * block
    for i in range(0, end, block):
        h = hash((h, raw[i:i + block]))
        out.append(h)
    return out


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's prompt as the index sees it: its kind, its byte length and the block chain (TEXT only)."""

    kind: str
    nbytes: int
    blocks: list[int]

    @property
    def hashed(self) -> bool:
        return self.kind == TEXT and bool(self.blocks)


NONE = Prompt(NO_TEXT, 0, [])


def classify(raw: bytes) -> str:
    """TEXT, IMAGE (any media part), TOKEN_IDS (`prompt` as ids) or NO_TEXT (tool calls only, empty contents)."""
    if _IDS.match(raw):
        return TOKEN_IDS
    if any(m in raw for m in _MEDIA):
        return IMAGE
    if raw[:1] == b'"':  # a completion prompt as one string
        return TEXT if len(raw) > 2 else NO_TEXT
    return TEXT if _TEXT_CONTENT.search(raw) else NO_TEXT


def prompt_of(messages: object, prompt: object, block: int = BLOCK_BYTES) -> Prompt:
    """The Prompt of a request body's `messages` (chat) or `prompt` (completions), each a msgspec.Raw or UNSET."""
    raw = messages if isinstance(messages, msgspec.Raw) else prompt if isinstance(prompt, msgspec.Raw) else None
    if raw is None:
        return NONE
    data = bytes(raw)  # msgspec.Raw is a view of the body: one copy of the prompt's bytes, dropped after hashing
    kind = classify(data)
    return Prompt(kind, len(data), chain(data, block) if kind == TEXT else [])


class BackendIndex:
    """The blocks one backend holds, bounded at `capacity` blocks: an LRU of two generations. New and re-used
    blocks go into the young set; when it holds half the capacity it becomes the old set and the old one is
    dropped whole, so the least recently used half goes at once (what stays was used within the last
    capacity/2 insertions). Two sets of ints: ~70 bytes a block, O(1) per block, no per-entry ordering."""

    __slots__ = ("young", "old", "capacity", "generation")

    def __init__(self, capacity: int, generation: int = 0) -> None:
        self.young: set[int] = set()
        self.old: set[int] = set()
        self.capacity = max(2, capacity)
        self.generation = generation  # the backend's generation it was built for (router.pools.Backend)

    def __len__(self) -> int:
        return len(self.young) + len(self.old)

    def holds(self, h: int) -> bool:
        return h in self.young or h in self.old

    def depth(self, blocks: list[int]) -> int:
        """How many leading blocks this backend holds. Blocks are inserted tail first, so a prefix is never
        older than its continuation and a held block's prefix is held too: a binary search finds the depth."""
        if not blocks or not self.holds(blocks[0]):
            return 0
        lo, hi = 1, len(blocks)  # blocks[:lo] held; blocks[hi:] not known to be
        if self.holds(blocks[hi - 1]):
            return hi
        hi -= 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.holds(blocks[mid - 1]):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(self, blocks: list[int]) -> None:
        """The backend was sent these blocks: they are the most recently used now (a prompt longer than half
        the capacity keeps its first half-capacity blocks)."""
        half = self.capacity // 2
        young = self.young
        for h in reversed(blocks[:half]):
            young.add(h)
            if len(young) >= half:  # mid-prompt too: its tail ages first, as a radix cache evicts leaves first
                self.old, self.young = young, set()
                young = self.young

    def truncate(self, blocks: list[int], keep: int) -> None:
        """The backend does not hold blocks[keep:] (it said so: fewer cached tokens than expected)."""
        for h in blocks[keep:]:
            self.young.discard(h)
            self.old.discard(h)

    def resize(self, capacity: int) -> None:
        self.capacity = max(2, capacity)
        if len(self) > self.capacity:
            self.old = set()  # shrunk below what it holds: the older half goes first
        if len(self.young) >= self.capacity // 2:
            self.old, self.young = self.young, set()
            if len(self.old) > self.capacity:
                self.old = set()


class PrefixIndex:
    """One BackendIndex per backend URL; a backend's entry is dropped when it leaves, is ejected, goes down or
    says it lost its cache, and rebuilt from what it is sent next."""

    def __init__(self, capacity: int) -> None:
        self.default_capacity = capacity
        self.by_url: dict[str, BackendIndex] = {}

    def of(self, url: str, generation: int = 0, capacity: int | None = None) -> BackendIndex:
        """The backend's index, made (empty, `capacity` blocks) when it has none for this generation."""
        idx = self.by_url.get(url)
        if idx is None or idx.generation != generation:
            idx = self.by_url[url] = BackendIndex(capacity or self.default_capacity, generation)
        return idx

    def peek(self, url: str, generation: int = 0) -> BackendIndex | None:
        idx = self.by_url.get(url)
        return idx if idx is not None and idx.generation == generation else None

    def forget(self, url: str) -> None:
        self.by_url.pop(url, None)

    def size(self, url: str) -> int:
        idx = self.by_url.get(url)
        return 0 if idx is None else len(idx)
