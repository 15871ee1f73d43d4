"""A family of small continuous-batching servers that are not our simulator: members as data, their physics, HTTP.

Independent of bench/sim on purpose (no import from it): a policy judged only on the simulator it was tuned on
is judged on that simulator's physics. Each member is a PAIR (a speculative server and a baseline one) with
its own step-time shape, acceptance process and prefill cost; `predict()` says what its parameters imply, the
tests check the servers deliver it. Serves the subset of SGLang 0.5.23 a proxy reads: /health, /v1/models,
/v1/chat/completions and /v1/completions (streamed or not, usage in the last chunk on request), /v1/loads
(running, waiting, max_running_requests, gen_throughput, speculative.accept_length), /server_info.

Library only: `spec-bench family` (bench/lab/familyserve.py) serves one pair from the command line.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
import uuid
import zlib
from collections import deque
from dataclasses import asdict, dataclass

from aiohttp import web

from router.tasks import cancel

JSON = "application/json"
SHAPES = ("linear", "convex", "saturating")
ACCEPT_PER = ("step", "request")
ACCEPT_DIST = ("fixed", "poisson")
# A streamed request gets a chunk at its first token, at its end, and whenever this many tokens are unsent:
# the router learns from durations and usage, not from chunk counts, and a chunk per step at 32 running costs
# this 2-core host more CPU than the physics being measured.
CHUNK_TOKENS = 16
# Steps the reported accept length and gen_throughput average over (SGLang: a window of recent steps).
WINDOW_STEPS = 40
# When the event loop falls this far (wall seconds) behind the modelled clock, the debt is dropped: a host
# starved of CPU makes the server slower than its parameters say rather than faster in bursts afterwards.
MAX_LAG = 0.05


@dataclass(frozen=True)
class Physics:
    """One server. Times in milliseconds of the server's own clock (the speedup divides them on the wall).

    step time of a decode batch of n:  linear  a + b*n;  convex  a + b*n + c*n^2;  saturating a + b*n/(1+n/c)
    (the step cost levels off: a server whose batch is memory-bound). A prefill forward admitting requests costs
    a + prefill_ms_per_ktok * prompt tokens / 1000, on top of the decode step it stalls. accept: mean tokens
    a request gets per decode step (1: no speculation), drawn per step or once per request, fixed (fractional
    tokens carried over) or 1 + Poisson(accept - 1) capped at max_accept."""

    a: float
    b: float
    c: float = 0.0
    shape: str = "linear"
    accept: float = 1.0
    accept_per: str = "step"
    accept_dist: str = "fixed"
    accept_spread: float = 0.0  # per request, fixed: uniform within +-spread of the mean
    max_accept: int = 5
    prefill_ms_per_ktok: float = 0.0
    prompt_tokens: int | None = None  # every prompt counts this many tokens (a long shared system prompt)
    max_running: int = 32

    def __post_init__(self) -> None:
        if self.shape not in SHAPES or self.accept_per not in ACCEPT_PER or self.accept_dist not in ACCEPT_DIST:
            raise ValueError(f"bad physics {self}")
        if self.a <= 0 or self.b < 0 or self.c < 0 or self.accept < 1 or self.max_running < 1:
            raise ValueError(f"bad physics {self}")
        if self.shape == "saturating" and self.c <= 0:
            raise ValueError("a saturating step needs c > 0 (the batch size where it bends)")

    @property
    def speculative(self) -> bool:
        return self.accept > 1.0

    def step_ms(self, n: int) -> float:
        if self.shape == "linear":
            return self.a + self.b * n
        if self.shape == "convex":
            return self.a + self.b * n + self.c * n * n
        return self.a + self.b * n / (1.0 + n / self.c)

    def prefill_ms(self, prompt_tokens: int) -> float:
        return self.prefill_ms_per_ktok * prompt_tokens / 1000.0

    def poisson_table(self) -> list[float]:
        """Cumulative probabilities of 1, 2, ..., max_accept accepted tokens (the cap takes the tail)."""
        lam, cum, out = self.accept - 1.0, 0.0, []
        for k in range(self.max_accept - 1):
            cum += math.exp(-lam) * lam ** k / math.factorial(k)
            out.append(cum)
        out.append(1.0)
        return out

    def _probs(self) -> list[float]:
        t = self.poisson_table()
        return [t[0]] + [t[i] - t[i - 1] for i in range(1, len(t))]

    def mean_accept(self) -> float:
        """E[tokens per decode step] of a request drawn per step."""
        if not self.speculative:
            return 1.0
        if self.accept_dist == "fixed":
            return self.accept
        return sum((k + 1) * p for k, p in enumerate(self._probs()))

    def mean_inverse_accept(self) -> float:
        """E[steps per token]: per step it is 1/E[A]; per request, E[1/A] over the requests' draws."""
        if not self.speculative or self.accept_per == "step":
            return 1.0 / self.mean_accept()
        if self.accept_dist == "poisson":
            return sum(p / (k + 1) for k, p in enumerate(self._probs()))
        s, m = self.accept_spread, self.accept
        return 1.0 / m if s <= 0 else math.log((1 + s) / (1 - s)) / (2 * s * m)


@dataclass(frozen=True)
class Member:
    name: str
    physics: str  # one line: what is different about it
    speculative: Physics
    baseline: Physics
    expect: str  # where the speculative server should win, by its parameters


# Prompt lengths: None counts the request's own text (~4 characters a token: bench's coding prompts are short).
MEMBERS: dict[str, Member] = {m.name: m for m in (
    Member("linear-12", "linear steps; fixed accept 1.9 per step; short prompts, no prefill cost",
           Physics(a=14.0, b=3.0, accept=1.9, max_running=16),
           Physics(a=10.0, b=0.5, max_running=32),
           "all-speculative ahead only at 1-2 requests"),
    Member("convex-10", "convex steps (a quadratic term); 1+Poisson accept per step, mean 2.6; short prompts",
           Physics(a=12.0, b=1.2, c=0.124, shape="convex", accept=2.6, accept_dist="poisson", max_running=24),
           Physics(a=9.0, b=0.4, c=0.01, shape="convex", max_running=32),
           "all-speculative ahead up to ~10 requests"),
    Member("saturating-never", "saturating step cost; accept 1.5 drawn once per request (+-20%); short prompts",
           Physics(a=14.0, b=3.0, c=8.0, shape="saturating", accept=1.5, accept_per="request",
                   accept_spread=0.2, max_running=32),
           Physics(a=8.0, b=2.0, c=8.0, shape="saturating", max_running=32),
           "the speculative server never ahead"),
    Member("prefill-long", "3000-token prompts whose prefill stalls the batch; 1+Poisson accept per request, "
                           "mean 2.4",
           Physics(a=13.0, b=1.2, accept=2.4, accept_per="request", accept_dist="poisson",
                   prefill_ms_per_ktok=25.0, prompt_tokens=3000, max_running=16),
           Physics(a=10.0, b=0.3, prefill_ms_per_ktok=20.0, prompt_tokens=3000, max_running=32),
           "all-speculative ahead at light load, the baseline from a few requests"),
    Member("issue28", "the issue's pair: 1+Poisson accept per step around 2.8, 500-token prompts prefilled on "
                      "admission; a baseline with cheaper steps",
           Physics(a=16.0, b=1.8, accept=2.8, accept_dist="poisson", prefill_ms_per_ktok=40.0,
                   prompt_tokens=500, max_running=16),
           Physics(a=9.0, b=0.35, prefill_ms_per_ktok=30.0, prompt_tokens=500, max_running=32),
           "all-speculative ahead up to ~10 requests"),
)}


def predict(p: Physics, n: int, tokens: int, prompt_tokens: int = 20) -> float:
    """Closed-loop output tok/s of server p with n clients each asking `tokens` tokens (server clock).

    A request's life: its prefill forward (first token), then (tokens-1) * E[steps per token] decode steps at
    the running batch; meanwhile about one other admission per running request stalls the batch by a prefill
    forward (Little's law). Beyond max_running the rest wait: the throughput is that at max_running."""
    m = min(n, p.max_running)
    pt = p.prompt_tokens if p.prompt_tokens is not None else prompt_tokens
    prefill = p.a + p.prefill_ms(pt)
    cycle = (tokens - 1) * p.mean_inverse_accept() * p.step_ms(m) + m * prefill
    return m * tokens / cycle * 1000.0


def request_rng(key: int, seed: int) -> random.Random:
    """The random stream of one request's own acceptance draw (key: the body's crc32; seed: the server's)."""
    return random.Random(key * 1_000_003 + seed)


def steps_per_token(p: Physics, body: bytes, seed: int) -> float:
    """Decode steps per token the server with physics p and seed gives the request with this body: for a
    per-request draw, 1 / its acceptance (what the judge reports as a configuration's luck); else the mean."""
    if not p.speculative or p.accept_per == "step":
        return p.mean_inverse_accept()
    return 1.0 / Engine(p, seed=seed)._draw_request(request_rng(zlib.crc32(body), seed))


# ---- the engine ----------------------------------------------------------------------------------

class Req:
    __slots__ = ("max_tokens", "prompt_tokens", "gen", "sent", "frac", "accept", "event", "done", "first_at",
                 "rid")

    def __init__(self, max_tokens: int, prompt_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.gen = 0
        self.sent = 0
        self.frac = 0.0
        self.accept = 1.0  # per-request draw (accept_per "request")
        self.event = asyncio.Event()
        self.done = False
        self.first_at: float | None = None
        self.rid = uuid.uuid4().hex


class Engine:
    """Continuous batching on a modelled clock: admit from the queue up to max_running (one prefill forward),
    then decode steps over everything running; sleeps each step's modelled time / speedup on the wall."""

    def __init__(self, physics: Physics, speedup: float = 1.0, seed: int = 0) -> None:
        if speedup <= 0:
            raise ValueError("speedup must be > 0")
        self.p = physics
        self.speedup = speedup
        self.seed = seed
        self.rng = random.Random(seed)
        self.table = physics.poisson_table()
        self.running: list[Req] = []
        self.waiting: deque[Req] = deque()
        self.wake = asyncio.Event()
        self.steps: deque[tuple[float, int, int]] = deque(maxlen=WINDOW_STEPS)  # (model ms, tokens, req-steps)
        self.completed = 0
        self.busy_ms = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await cancel(self._task)

    def submit(self, r: Req, key: int | None = None) -> None:
        """Queue a request. `key` (the body's checksum) seeds a per-request acceptance: the same request gets the
        same draw whichever configuration sent it (common random numbers: two routers compared on the same
        prompts differ by their routing, not by which requests drew a hard prompt). None: the engine's stream."""
        if self.p.speculative and self.p.accept_per == "request":
            rng = self.rng if key is None else request_rng(key, self.seed)
            r.accept = self._draw_request(rng)
        self.waiting.append(r)
        self.wake.set()

    def drop(self, r: Req) -> None:
        """A client went away: free its slot (SGLang aborts the request)."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)

    def _draw_request(self, rng: random.Random) -> float:
        p = self.p
        if p.accept_dist == "poisson":
            return float(self._poisson(rng))
        return p.accept * (1.0 + p.accept_spread * (2.0 * rng.random() - 1.0))

    def _poisson(self, rng: random.Random | None = None) -> int:
        u = (rng or self.rng).random()
        for k, cum in enumerate(self.table):
            if u <= cum:
                return k + 1
        return len(self.table)

    def _tokens(self, r: Req) -> int:
        p = self.p
        if not p.speculative:
            return 1
        if p.accept_per == "step" and p.accept_dist == "poisson":
            return self._poisson()
        mean = p.accept if p.accept_per == "step" else r.accept
        if p.accept_per == "request" and p.accept_dist == "poisson":
            return int(mean)
        r.frac += mean
        k = int(r.frac)
        r.frac -= k
        return k

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        target = loop.time()
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
                target = loop.time()
            admitted: list[Req] = []
            while self.waiting and len(self.running) + len(admitted) < self.p.max_running:
                admitted.append(self.waiting.popleft())
            decoding = list(self.running)
            ms = self.p.step_ms(len(decoding)) if decoding else 0.0
            if admitted:
                ms += self.p.a + sum(self.p.prefill_ms(r.prompt_tokens) for r in admitted)
            self.running.extend(admitted)
            target += ms / 1000.0 / self.speedup
            delay = target - loop.time()
            if delay < -MAX_LAG:
                target = loop.time()
            await asyncio.sleep(max(delay, 0.0))
            self.busy_ms += ms
            now = loop.time()
            toks = 0
            for r in admitted:
                if r in self.running:  # not dropped during the step
                    r.gen, r.first_at = 1, now
                    self._emit(r)
            for r in decoding:
                if r not in self.running:
                    continue
                k = self._tokens(r)
                k = min(k, r.max_tokens - r.gen)
                r.gen += k
                toks += k
                self._emit(r)
            if decoding:
                self.steps.append((ms, toks, len(decoding)))
            if any(r.done for r in self.running):
                self.running = [r for r in self.running if not r.done]

    def _emit(self, r: Req) -> None:
        if r.gen >= r.max_tokens:
            r.done = True
            self.completed += 1
            r.event.set()
        elif r.sent == 0 or r.gen - r.sent >= CHUNK_TOKENS:
            r.event.set()

    def accept_length(self) -> float:
        req_steps = sum(s for _, _, s in self.steps)
        return sum(t for _, t, _ in self.steps) / req_steps if req_steps else self.p.mean_accept()

    def gen_throughput(self) -> float:
        ms = sum(m for m, _, _ in self.steps)
        return sum(t for _, t, _ in self.steps) / ms * 1000.0 if ms else 0.0


# ---- HTTP ----------------------------------------------------------------------------------------

def loads_document(e: Engine, spec: bool = True) -> dict:
    """The engine's /v1/loads document (its `loads` list; `spec`: with the speculative figures, as
    include=spec or all asks): what the server answers, and what bench.lab.routesim hands the router's parser."""
    p = e.p
    load = {"dp_rank": 0, "num_running_reqs": len(e.running), "num_waiting_reqs": len(e.waiting),
            "num_used_tokens": sum(r.prompt_tokens + r.gen for r in e.running), "max_total_num_tokens": 1 << 20,
            "max_running_requests": p.max_running, "token_usage": 0.0,
            "gen_throughput": round(e.gen_throughput(), 2), "cache_hit_rate": 0.0,
            "utilization": min(1.0, len(e.running) / p.max_running)}
    if p.speculative and spec:
        length = e.accept_length()
        load["speculative"] = {"accept_length": round(length, 4),
                               "accept_rate": round((length - 1) / max(p.max_accept - 1, 1), 4)}
    return {"loads": [load]}


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": "BadRequestError", "param": None,
                              "code": status}, status=status)


def _prompt_tokens(body: dict, chat: bool) -> int:
    if chat:
        text = "".join(str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
    else:
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    return max(1, len(text) // 4)


class FamilyServer:
    """One member server over HTTP on 127.0.0.1 (port 0 by default)."""

    def __init__(self, physics: Physics, speedup: float = 1.0, model: str = "default", seed: int = 0,
                 name: str = "family") -> None:
        self.physics = physics
        self.model = model
        self.name = name
        self.engine = Engine(physics, speedup, seed)
        self.requests = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 << 20)
        r = app.router
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/_family/stats", self.stats)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self.engine.start()
        self.runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, backlog=4096)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{bound}"
        return bound

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        await self.engine.stop()

    # ---- generation
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        media = request.headers.get("content-type", "").lower().split(";", 1)[0].strip()
        if media != JSON:
            return _error("Unsupported Media Type: Only 'application/json' is allowed")
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return _error("JSON decode error")
        if not isinstance(body, dict):
            return _error("the body must be a JSON object")
        if chat and not isinstance(body.get("messages"), list):
            return _error("messages: field required")
        if not chat and "prompt" not in body:
            return _error("prompt: field required")
        n = body.get("max_completion_tokens") or body.get("max_tokens") or 128
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return _error("max_tokens must be a positive integer")
        self.requests += 1
        pt = self.physics.prompt_tokens or _prompt_tokens(body, chat)
        req = Req(n, pt)
        model = str(body.get("model") or "default")
        stream = bool(body.get("stream"))
        usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
        self.engine.submit(req, zlib.crc32(raw))
        try:
            if not stream:
                while not req.done:
                    await req.event.wait()
                    req.event.clear()
                return web.json_response(self._whole(req, model, chat))
            return await self._stream(request, req, model, chat, usage_wanted)
        finally:
            if not req.done:
                self.engine.drop(req)

    def _usage(self, req: Req) -> dict:
        return {"prompt_tokens": req.prompt_tokens, "completion_tokens": req.gen,
                "total_tokens": req.prompt_tokens + req.gen}

    def _whole(self, req: Req, model: str, chat: bool) -> dict:
        text = "tok " * req.gen
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": "length", "matched_stop": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "matched_stop": None}
            obj = "text_completion"
        return {"id": req.rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
                "usage": self._usage(req)}

    async def _stream(self, request: web.Request, req: Req, model: str, chat: bool,
                      usage_wanted: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choice: dict | None, usage: dict | None = None) -> bytes:
            doc = {"id": req.rid, "object": obj, "created": created, "model": model,
                   "choices": [choice] if choice is not None else []}
            if usage is not None:
                doc["usage"] = usage
            return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

        def piece(text: str, finish: str | None = None) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        # SGLang sends the role chunk with the first output, after the prefill (so does bench/sim): a router's
        # time to first byte is then the time to first token.
        role = event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}) if chat else b""
        while True:
            await req.event.wait()
            req.event.clear()
            k = req.gen - req.sent
            if k > 0:
                req.sent = req.gen
                await resp.write(role + event(piece("tok " * k)))
                role = b""
            if req.done:
                break
        tail = event(piece("", "length"))
        if usage_wanted:
            tail += event(None, self._usage(req))
        await resp.write(tail + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- the routes a router reads
    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 1700000000, "owned_by": "sglang", "root": self.model,
             "parent": None, "max_model_len": 131072}]})

    async def loads(self, request: web.Request) -> web.Response:
        include = request.query.get("include", "all")
        doc = loads_document(self.engine, "spec" in include or "all" in include)
        return web.json_response({"timestamp": time.time(), "version": "0.5.23", **doc})

    async def server_info(self, request: web.Request) -> web.Response:
        state: dict = {"last_gen_throughput": self.engine.gen_throughput(),
                       "effective_max_running_requests_per_dp": self.physics.max_running}
        if self.physics.speculative:
            state["avg_spec_accept_length"] = self.engine.accept_length()
        return web.json_response({"model_path": self.model, "served_model_name": self.model, "tp_size": 1,
                                  "max_running_requests": self.physics.max_running, "version": "0.5.23",
                                  "internal_states": [state]})

    async def stats(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response({"name": self.name, "running": len(e.running), "waiting": len(e.waiting),
                                  "requests": self.requests, "completed": e.completed,
                                  "busy_s": round(e.busy_ms / 1000.0, 3), "physics": asdict(self.physics)})


async def start_pair(member: Member, speedup: float, port: int = 0, port_b: int = 0,
                     seed: int = 0) -> tuple[FamilyServer, FamilyServer]:
    spec = FamilyServer(member.speculative, speedup, seed=seed, name=f"{member.name}/speculative")
    base = FamilyServer(member.baseline, speedup, seed=seed + 1, name=f"{member.name}/baseline")
    await spec.start(port=port)
    await base.start(port=port_b)
    return spec, base


def describe(member: Member, tokens: int = 96, levels=(1, 2, 4, 8, 16, 32)) -> str:
    lines = [f"{member.name}: {member.physics}; {member.expect}"]
    for role, p in (("speculative", member.speculative), ("baseline", member.baseline)):
        figs = ", ".join(f"{n}: {predict(p, n, tokens):.0f}" for n in levels)
        lines.append(f"  {role:11s} predicted closed-loop tok/s at {tokens} tokens: {figs}")
    return "\n".join(lines)
