"""The batching model: continuous batching of simulated requests on one engine loop that keeps absolute time."""
from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import random
import re
import sys
import time
from dataclasses import dataclass, field

from bench.sim.gpu import Gpu
from bench.sim.profiles import Profile
from bench.sim.radix import Node, RadixCache
from bench.sim.specadaptive import Controller, check_profile

_WORDS = (
    "the of and to in is that for it as with was on be by this are from or at an which not have but "
    "model token batch server request stream decode draft accept verify cache queue router latency "
    "value function return result data index list class node graph tree path state error input output"
).split()
# a few punctuation tokens so that common stop strings (".", "\n") can match
_PUNCT = [".", ",", "\n", ":", ";"]
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_CODE_RE = re.compile(
    r"`|\{|\}|\b(def|class|function|import|return|code|python|rust|golang|go|java|javascript|typescript|c\+\+"
    r"|bash|shell|git|docker\w*|kubernetes|pytest|unit tests?|regex|regular expression|sql|api|thread\w*"
    r"|compile\w*|bug|debug\w*|script|json|yaml|ci|index|quer(y|ies)|b-tree|cap theorem|memory usage"
    r"|fastapi|pydantic|deployment|manifest|xargs)\b",
    re.IGNORECASE,
)
# steps the loop may run back to back when it is behind schedule, before it lets the handlers run
CATCH_UP_STEPS = 8
# Without max_tokens and with ignore_eos a request would run to the context length; stop somewhere sane.
MAX_GENERATED_TOKENS = 16384


class QueueFull(Exception):
    """The waiting queue holds --max-queued-requests requests already."""


def count_tokens(text: str) -> int:
    """A stand-in tokenizer: words and punctuation marks (about what a BPE tokenizer gives for English)."""
    return len(_TOKEN_RE.findall(text))


def tokenize(text: str) -> list[str]:
    """The stand-in tokenizer's tokens (interned: a cache of a million tokens holds one copy of each word)."""
    return list(map(sys.intern, _TOKEN_RE.findall(text)))


# chat template tokens around each message and before the reply (Kimi's <|im_user|>...<|im_end|> shape)
_MSG_OPEN, _MSG_MIDDLE, _MSG_END = "<|im_start|>", "<|im_middle|>", "<|im_end|>"


def chat_key(messages: list[tuple[str, str]]) -> list[str]:
    """A chat prompt's tokens: 4 template tokens per message (open, role, middle, end) plus 3 for the reply."""
    key: list[str] = []
    for role, text in messages:
        key += [_MSG_OPEN, sys.intern(role), _MSG_MIDDLE]
        key += tokenize(text)
        key.append(_MSG_END)
    key += [_MSG_OPEN, "assistant", _MSG_MIDDLE]
    return key


def is_coding(text: str) -> bool:
    return bool(_CODE_RE.search(text))


PROMPT_MIXES = ("coding", "chat")
# a request's accept length is drawn as class mean + z * profile.accept_length_spread, z ~ N(0, 1) within +-2
ACCEPT_Z_CLIP = 2.0
# how many recent verify steps SGLang-style accept-length figures average over (its decode log interval)
ACCEPT_WINDOW_STEPS = 40


@functools.lru_cache(maxsize=4096)
def _accept_rate(mean_len: float, steps: int) -> float:
    """Per-draft acceptance a with 1 + a + a^2 + ... + a^steps == mean_len (bisection)."""
    if mean_len <= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(steps + 1)) < mean_len:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def request_accept_length(profile: Profile, mean: float, z: float) -> float:
    """One request's mean accept length: its class mean moved by z spreads, within [1, num_steps + 1]."""
    length = mean + z * profile.accept_length_spread
    return round(max(1.0, min(float(profile.max_accept), length)), 3)  # rounded: the rate cache stays small


class Outbox:
    """What the engine has emitted for one request and its handler has not sent yet (a lean asyncio.Queue)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    async def get_all(self) -> list:
        """Everything pending (waiting for at least one item): a handler that fell behind catches up at once."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


@dataclass(eq=False)
class SimRequest:
    """One generation: its deterministic output, where it ends, and what the engine has emitted so far."""

    rid: str
    prompt_text: str
    prompt_tokens: int
    tokens: list[str]  # text of each output token up to where it finishes
    finish_reason: str  # "stop" | "length"
    matched_stop: int | str | None
    text: str  # the final output text (stop string excluded)
    accept_rate: float
    rng: random.Random
    coding: bool = False  # prompt class: code accepts more draft tokens
    accept_z: float = 0.0  # where this request's accept length sits around its class mean (in spreads)
    prefill_left: int = 0  # prompt tokens still to prefill (chunked prefill spreads a long prompt over steps)
    prefilled: bool = False
    # the prompt's tokens for the prefix cache (None: not cacheable, e.g. a request built without its text)
    key: list | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache held at admission (SGLang's meta_info cached_tokens)
    cache_node: Node | None = None  # the tree node this request holds (locked) while it runs
    reserve: int = 0  # KV tokens reserved for it outside the tree (its uncached prompt, then its output)
    stream: bool = False
    generated: int = 0
    emitted_chars: int = 0
    state: str = "new"  # new -> waiting -> running -> finished | aborted
    arrival: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    last_token_at: float | None = None
    itl: list[float] = field(default_factory=list)  # wall seconds between consecutive emissions
    outbox: Outbox = field(default_factory=Outbox)

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return self.state in ("finished", "aborted")


def build_request(
    rid: str, prompt_text: str, prompt_tokens: int, *, profile: Profile, seed: int,
    max_tokens: int | None, stop: list[str], ignore_eos: bool, stream: bool, key: list | None = None,
) -> SimRequest:
    """Decide the whole output of a request up front from (prompt, seed): same inputs, same bytes."""
    digest = hashlib.sha256(f"{seed}\x00{prompt_text}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    natural = rng.randint(*profile.natural_output_tokens)
    limit = MAX_GENERATED_TOKENS if max_tokens is None else max_tokens
    limit = max(0, min(limit, profile.context_len - prompt_tokens))
    eos_first = not ignore_eos and natural <= limit
    n = natural if eos_first else limit
    # the last token of an EOS ending is the EOS token itself: counted, not shown
    n_text = n - 1 if eos_first else n
    # token by token from one stream, so a longer output starts with the shorter one's text
    tokens = []
    for i in range(n_text):
        r = rng.random()
        if r < 0.06:
            tokens.append(_PUNCT[int(r / 0.06 * len(_PUNCT))])
        else:
            w = _WORDS[rng.randrange(len(_WORDS))]
            tokens.append(w if i == 0 else " " + w)
    finish_reason, matched = ("stop", profile.eos_token_id) if eos_first else ("length", None)
    text = "".join(tokens)
    hit = _first_stop(text, stop)
    if hit is not None:
        pos, s = hit
        end, cut = 0, len(tokens)
        for i, t in enumerate(tokens):
            end += len(t)
            if end >= pos + len(s):
                cut = i + 1
                break
        tokens = tokens[:cut]
        text = text[:pos]
        finish_reason, matched = "stop", s
    elif eos_first:
        tokens.append("")  # the EOS token: counted in completion_tokens, never shown
    coding = is_coding(prompt_text)
    # this request's own acceptance, drawn around its class mean (clipped: no request is an extreme outlier)
    accept_z = max(-ACCEPT_Z_CLIP, min(ACCEPT_Z_CLIP, rng.gauss(0.0, 1.0)))
    kind_len = profile.accept_length_coding if coding else profile.accept_length_general
    rate = _accept_rate(kind_len, profile.speculative_num_steps) if profile.speculative else 0.0
    return SimRequest(
        rid=rid, prompt_text=prompt_text, prompt_tokens=prompt_tokens, tokens=tokens,
        finish_reason=finish_reason, matched_stop=matched, text=text, accept_rate=rate, rng=rng,
        stream=stream, coding=coding, accept_z=accept_z, key=key,
    )


def _first_stop(text: str, stop: list[str]) -> tuple[int, str] | None:
    best = None
    for s in stop:
        pos = text.find(s) if s else -1
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


class Engine:
    """Continuous batching on one loop: admit, run a step whose length the profile gives, emit, repeat.

    Each step's end is an absolute deadline on the wall clock (sim time / speedup); when the loop is
    late it runs the next step at once instead of sleeping, so small timer errors do not accumulate.
    """

    def __init__(self, profile: Profile, *, speedup: float = 1.0, max_running_requests: int | None = None,
                 max_queued_requests: int | None = None, max_total_tokens: int | None = None,
                 gpu: Gpu | None = None, radix_cache: bool = True, adaptive_config: dict | None = None) -> None:
        self.profile = profile
        # --speculative-adaptive: SGLang's per-batch-size controller picks each step's draft steps
        check_profile(adaptive_config, profile)
        self.adaptive: Controller | None = None
        if profile.speculative_adaptive:
            self.adaptive = Controller(adaptive_config, initial=profile.speculative_num_steps)
        self.last_draft_steps = profile.speculative_num_steps if profile.speculative else 0
        self.speedup = speedup
        self.max_running = max_running_requests or profile.max_running_requests
        self.max_queued = max_queued_requests
        # KV capacity in tokens (a co-located server gets its memory share of the profile's)
        self.max_total_tokens = max_total_tokens or profile.max_total_num_tokens
        self.gpu = gpu
        if gpu is not None:
            gpu.engines.append(self)
        # KV reserved for running requests outside the prefix cache: each one's uncached prompt until it is
        # prefilled (then it enters the tree), and its whole output (it enters the tree when the request ends)
        self.reserved_tokens = 0
        # SGLang's RadixCache (None: --disable-radix-cache); it shares max_total_tokens with the reservations
        self.cache: RadixCache | None = RadixCache() if radix_cache else None
        self.prompt_tokens_admitted = 0  # prompt tokens of admitted requests, and how many of them were cached
        self.cached_tokens_total = 0
        self.prefill_computed_total = 0  # prompt tokens actually prefilled (SGLang's total_prefill_uncached_tokens)
        self.last_cache_hit_rate = 0.0  # hit / (hit + computed) of the last prefill step, as SGLang reports it
        self._hit_window: collections.deque[tuple[float, int, int]] = collections.deque()  # (wall, hit, total)
        self.deadline = 0.0  # wall time at which the current step ends
        self.busy_s = 0.0  # simulated seconds of GPU time this engine's steps took
        self.gpu_wait_s = 0.0  # simulated seconds its steps waited for a co-located server's steps
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self.running: list[SimRequest] = []
        self.requests_total = 0
        self.completed_total = 0
        self.aborted_total = 0
        self.generation_tokens_total = 0
        self.verify_calls_total = 0
        self.steps_total = 0
        # (tokens gained, request-steps, draft steps) of the recent speculative steps: the accept length and
        # rate SGLang reports
        self._accept_recent: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=ACCEPT_WINDOW_STEPS)
        # drift (POST /_sim/drift): an accept length for every request, or every prompt taken as one class
        self.drift_accept_length: float | None = None
        self.drift_prompt_mix: str | None = None
        self.drift_changes = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (wall, tokens) per step
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.on_finish = None  # callback(req) when a request finishes or is aborted

    # -- state read by the server --------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_queued(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def used_tokens(self) -> int:
        """KV tokens in use (SGLang: total minus free minus evictable): running requests' tokens, a shared
        prefix counted once; cached tokens no running request holds are not counted."""
        if self.cache is None:
            return sum(r.prompt_tokens + r.generated for r in self.running)
        own = sum(r.generated + (0 if r.prefilled and r.key is not None
                                 else r.prompt_tokens - r.cached_tokens - r.prefill_left) for r in self.running)
        return self.cache.protected_size + own

    def cache_size(self) -> int:
        return self.cache.total_size if self.cache is not None else 0

    def recent_cache_hit_rate(self, window: float = 15.0) -> float:
        """Cached / prompt tokens prefilled over the last `window` simulated seconds (SGLang's 15 s window)."""
        horizon = time.monotonic() - window / self.speedup
        while self._hit_window and self._hit_window[0][0] < horizon:
            self._hit_window.popleft()
        total = sum(t for _, _, t in self._hit_window)
        return sum(h for _, h, _ in self._hit_window) / total if total else 0.0

    def token_usage(self) -> float:
        return min(1.0, self.used_tokens() / self.max_total_tokens)

    def gen_throughput(self, window: float = 5.0) -> float:
        """Generated tokens per simulated second over the last `window` simulated seconds."""
        now = time.monotonic()
        horizon = now - window / self.speedup
        tokens = sum(t for w, t in self._recent if w >= horizon)
        return tokens / window if tokens else 0.0

    def avg_accept_length(self) -> float:
        if not self.profile.speculative:
            return 1.0
        gained = sum(k for k, _, _ in self._accept_recent)
        if not gained:
            return self.mean_accept_length(coding=self.drift_prompt_mix == "coding")
        return gained / sum(n for _, n, _ in self._accept_recent)

    def avg_accept_rate(self) -> float:
        """Accepted drafts / proposed drafts over the recent verify steps (SGLang's spec_accept_rate)."""
        if not self.profile.speculative:
            return 0.0
        proposed = sum(n * k for _, n, k in self._accept_recent)
        if not proposed:
            return (self.avg_accept_length() - 1) / self.profile.speculative_num_steps
        return sum(g - n for g, n, _ in self._accept_recent) / proposed

    # -- acceptance and its drift ----------------------------------------------------------------
    def mean_accept_length(self, coding: bool) -> float:
        """The mean accept length a request of this prompt class gets now (drift included)."""
        p = self.profile
        if not p.speculative:
            return 1.0
        if self.drift_accept_length is not None:
            return self.drift_accept_length
        if self.drift_prompt_mix is not None:
            coding = self.drift_prompt_mix == "coding"
        return p.accept_length_coding if coding else p.accept_length_general

    def _rate_for(self, req: SimRequest) -> float:
        p = self.profile
        if not p.speculative:
            return 0.0
        length = request_accept_length(p, self.mean_accept_length(req.coding), req.accept_z)
        return _accept_rate(length, p.speculative_num_steps)

    def drift(self) -> dict:
        return {"accept_length": self.drift_accept_length, "prompt_mix": self.drift_prompt_mix,
                "accept_length_general": self.mean_accept_length(coding=False),
                "accept_length_coding": self.mean_accept_length(coding=True)}

    def set_drift(self, update: dict) -> dict:
        """Partial update of the drift switches (a key with null resets it); applies to running requests too.

        Raises ValueError with a one-line message on a bad field."""
        unknown = set(update) - {"accept_length", "prompt_mix"}
        if unknown:
            raise ValueError(f"unknown drift field(s): {', '.join(sorted(unknown))}")
        length, mix = self.drift_accept_length, self.drift_prompt_mix
        if "accept_length" in update:
            length = update["accept_length"]
            if length is not None:
                cap = self.profile.max_accept
                if not self.profile.speculative:
                    raise ValueError("accept_length: this server does not speculate (its accept length is 1)")
                if isinstance(length, bool) or not isinstance(length, int | float) or not 1.0 <= length <= cap:
                    raise ValueError(f"accept_length must be a number from 1 to {cap} (num_steps + 1)")
                length = float(length)
        if "prompt_mix" in update:
            mix = update["prompt_mix"]
            if mix is not None and mix not in PROMPT_MIXES:
                raise ValueError(f"prompt_mix must be one of {', '.join(PROMPT_MIXES)} or null")
        self.drift_accept_length, self.drift_prompt_mix = length, mix
        self.drift_changes += 1
        for req in self.running:
            req.accept_rate = self._rate_for(req)
        return self.drift()

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for req in list(self.running) + list(self.waiting):
            self.abort(req)
        if self.gpu is not None:
            self.gpu.idle(self)  # a co-located peer waiting for this engine's turn must not wait forever

    def submit(self, req: SimRequest) -> None:
        # count only the requests that will have to wait: ones a free slot takes at the next step do not
        must_wait = len(self.running) + len(self.waiting) + 1 - self.max_running
        if self.max_queued is not None and must_wait > self.max_queued:
            raise QueueFull("The request queue is full.")
        req.state = "waiting"
        req.arrival = time.monotonic()
        self.requests_total += 1
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> bool:
        """Free the request's slot at once; True if it was still queued or running."""
        if req.done or req.state == "new":
            return False
        if req.state == "waiting":
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self._release(req)
        req.state = "aborted"
        req.finished_at = time.monotonic()
        self.aborted_total += 1
        if self.on_finish is not None:
            self.on_finish(req)
        return True

    # -- the loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
        deadline = time.monotonic()
        if self.gpu is not None:
            self.gpu.ready(self, deadline)
        behind = 0
        while True:
            if not self.running and not self.waiting:
                if self.gpu is not None:
                    self.gpu.idle(self)
                self._wake.clear()
                await self._wake.wait()
                deadline = time.monotonic()  # idle: the next step starts now, not in the past
                if self.gpu is not None:
                    self.gpu.ready(self, deadline)
            admitted = self._admit()
            decoding = [r for r in self.running if r.prefilled]
            now = time.monotonic()
            for req in admitted:
                req.state = "running"
                req.admitted_at = now
                req.accept_rate = self._rate_for(req)
                req.prefill_left = req.prompt_tokens - req.cached_tokens
                self.running.append(req)
            prefill_tokens, pairs, prefilled = self._prefill_chunk()
            draft_steps = self.draft_steps(len(decoding))
            step = self.step_ms(decoding, draft_steps) + self.profile.prefill_ms(prefill_tokens, pairs)
            if self.gpu is not None:
                await self.gpu.wait_turn(self, deadline)
            deadline = self._schedule(deadline, step)
            delay = deadline - time.monotonic()
            if delay > 0:
                behind = 0
                await asyncio.sleep(delay)
            else:
                # late: catch up with the next steps at once; yield now and then so handlers write (the
                # steps they missed go out in one write) and new requests get in
                behind += 1
                if behind % CATCH_UP_STEPS == 0:
                    await asyncio.sleep(0)
            self._emit(prefilled, decoding, draft_steps)

    def draft_steps(self, batch: int) -> int:
        """Draft steps of the next decode step: the profile's, or the adaptive controller's at this batch size."""
        if self.adaptive is not None and batch:
            self.last_draft_steps = self.adaptive.steps_for(batch)
        return self.last_draft_steps if self.profile.speculative else 0

    def step_ms(self, decoding: list[SimRequest], draft_steps: int | None = None) -> float:
        """A decode step: the profile's curve at this batch size plus the KV the batch's attention reads."""
        if not decoding:
            return 0.0
        if self.adaptive is not None:
            steps = self.draft_steps(len(decoding)) if draft_steps is None else draft_steps
            step = self.profile.adaptive_step_ms(steps, len(decoding))
        else:
            step = self.profile.step_ms(len(decoding))
        if self.profile.kv_ms_per_ktoken:
            held = sum(r.prompt_tokens + r.generated for r in decoding)
            step += self.profile.kv_ms_per_ktoken * held / 1000.0
        return step

    def _prefill_chunk(self) -> tuple[int, int, list[SimRequest]]:
        """This step's prefill: up to chunked_prefill_size uncached prompt tokens, oldest request first.

        Returns (tokens prefilled now, their causal attention pairs, the requests whose prefill completes).
        A chunk's tokens attend to everything before them, the cached prefix included: a chunk of t tokens
        starting at position s makes t*s + t(t+1)/2 query-key pairs (SGLang's `_prefill_attention_pairs`)."""
        budget = self.profile.chunked_prefill_size
        tokens, pairs, hit, done = 0, 0, 0, []
        for req in self.running:
            if req.prefilled:
                continue
            if req.prefill_left and not budget:
                break
            start = req.prompt_tokens - req.prefill_left
            if start == req.cached_tokens:  # its first chunk: the cache hit counts in this prefill batch
                hit += req.cached_tokens
            take = min(req.prefill_left, budget)
            req.prefill_left -= take
            budget -= take
            tokens += take
            pairs += take * start + take * (take + 1) // 2
            if not req.prefill_left:
                req.prefilled = True
                done.append(req)
                self._cache_prompt(req)
        self.prefill_computed_total += tokens
        if tokens or hit:
            self.last_cache_hit_rate = hit / (hit + tokens)
            now = time.monotonic()
            self._hit_window.append((now, hit, hit + tokens))
            while now - self._hit_window[0][0] > 15.0 / self.speedup:
                self._hit_window.popleft()
        return tokens, pairs, done

    # -- the prefix cache ------------------------------------------------------------------------
    def _cache_prompt(self, req: SimRequest) -> None:
        """After prefill the prompt's KV enters the tree, held by the request; tokens another request put
        there meanwhile are duplicates and freed. Its reservation keeps only its output."""
        if self.cache is None or req.key is None:
            return  # no tree: the prompt's KV stays the request's own until it ends
        own = req.prompt_tokens - req.cached_tokens
        req.reserve -= own
        self.reserved_tokens -= own
        _, node = self.cache.insert(req.key)
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = node

    def _release(self, req: SimRequest) -> None:
        """A request leaves the batch: what it computed (prompt, then output but its last token, whose KV is
        never written) enters the tree unheld, evictable from now on; its reservation is freed."""
        self.reserved_tokens -= req.reserve
        req.reserve = 0
        cache = self.cache
        if cache is None or req.key is None:
            return
        if req.prefilled and req.generated > 1:
            out = tokenize("".join(req.tokens[:req.generated - 1]))
            _, node = cache.insert(req.key + out)
            cache.unlock(req.cache_node)
            # the insert may have needed room beyond what the request held: keep the total within capacity
            over = cache.total_size + self.reserved_tokens - self.max_total_tokens
            if over > 0:
                cache.evict(over)
        elif req.cache_node is not None:
            cache.unlock(req.cache_node)
        req.cache_node = None

    def _admit(self) -> list[SimRequest]:
        """Waiting requests (first come, first served) that fit in a batch slot and in the KV capacity.

        A request's longest cached prefix (at most all of its prompt but the last token, as SGLang matches)
        is held for it; it needs room for the rest of its prompt and its whole output, and cached tokens no
        running request holds are evicted (least recently used first) to make that room."""
        admitted: list[SimRequest] = []
        cache = self.cache
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            req = self.waiting[0]
            matched, node = 0, None
            if cache is not None and req.key is not None and req.prompt_tokens > 1:
                matched, node = cache.match_prefix(req.key, req.prompt_tokens - 1)  # no copy of the key
                cache.lock(node)
            need = req.prompt_tokens - matched + len(req.tokens)
            free = self.max_total_tokens - self.reserved_tokens - self.cache_size()
            if need > free and cache is not None:
                free += cache.evict(need - free)
            # a request larger than the whole pool still runs alone rather than wait forever
            if need > free and (self.running or admitted):
                if node is not None:
                    cache.unlock(node)
                break
            req.cached_tokens, req.cache_node, req.reserve = matched, node, need
            self.reserved_tokens += need
            self.prompt_tokens_admitted += req.prompt_tokens
            self.cached_tokens_total += matched
            admitted.append(self.waiting.popleft())
        return admitted

    def _schedule(self, deadline: float, step_ms: float) -> float:
        """The wall time the next step ends; on shared GPUs it first waits for the other server's step."""
        if self.gpu is None:
            end = deadline + step_ms / 1000.0 / self.speedup
        else:
            begin, end = self.gpu.reserve(self, deadline, step_ms, self.speedup)
            self.gpu_wait_s += (begin - deadline) * self.speedup
        self.busy_s += step_ms / 1000.0
        self.deadline = end
        return end

    def _emit(self, admitted: list[SimRequest], decoding: list[SimRequest], draft_steps: int | None = None) -> None:
        now = time.monotonic()
        self.steps_total += 1
        steps = self.profile.speculative_num_steps if draft_steps is None else draft_steps
        spec = self.profile.speculative and steps > 0
        if spec and decoding:
            self.verify_calls_total += 1
        gained_total = 0
        for req in admitted:
            if req.state == "running":  # not aborted while its prefill ran
                gained_total += self._advance(req, 1, now)
        spec_gained = spec_n = 0
        accepted: list[int] | None = [] if self.adaptive is not None else None
        for req in decoding:
            if req.state != "running":
                continue
            k = 1
            if spec:
                while k <= steps and req.rng.random() < req.accept_rate:
                    k += 1
                spec_gained += k
                spec_n += 1
            if accepted is not None:
                accepted.append(k - 1)
            gained_total += self._advance(req, k, now)
        if spec_n:
            self._accept_recent.append((spec_gained, spec_n, steps))
        if accepted:
            self.adaptive.observe(len(decoding), accepted)
        self.generation_tokens_total += gained_total
        self._recent.append((now, gained_total))
        horizon = now - 30.0 / self.speedup
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()

    def _advance(self, req: SimRequest, k: int, now: float) -> int:
        start = req.generated
        total = len(req.tokens)
        if start + k > total:
            k = total - start
        end = start + k
        req.generated = end
        piece = req.tokens[start] if k == 1 else "".join(req.tokens[start:end])
        # never show text past a matched stop string
        room = len(req.text) - req.emitted_chars
        if len(piece) > room:
            piece = piece[:max(room, 0)]
        req.emitted_chars += len(piece)
        if req.first_token_at is None:
            req.first_token_at = now
        else:
            req.itl.append(now - req.last_token_at)
        req.last_token_at = now
        finished = end >= total
        if finished:
            req.state = "finished"
            req.finished_at = now
            self.running.remove(req)
            self._release(req)
            self.completed_total += 1
            if self.on_finish is not None:
                self.on_finish(req)
        req.outbox.put_nowait((piece, finished))
        return k
