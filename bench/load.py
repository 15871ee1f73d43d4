"""Load generation against one OpenAI-compatible URL: closed loop at fixed concurrency or open-loop
Poisson arrivals, streaming, one RequestRecord per request."""
from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import aiohttp

BUILTIN_PROMPT_SETS = ("coding", "general")


class BenchInputError(Exception):
    """A user-caused problem (bad flag, bad prompt file, unreachable target): one line, exit 2."""


@dataclass(slots=True)
class Prompt:
    """One request body template: chat `messages` or completions `prompt`."""

    messages: list | None = None
    prompt: str | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"


@dataclass(slots=True)
class RequestRecord:
    """What one request looked like from the client. Times are time.perf_counter() seconds."""

    start: float
    end: float = 0.0
    ttft: float | None = None  # seconds from start to the first chunk carrying text
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    output_tokens: int = 0  # usage.completion_tokens (chunk count if the server sent no usage)
    prompt_tokens: int = 0
    usage_reported: bool = False
    # usage.prompt_tokens_details.cached_tokens (SGLang sends it only with --enable-cache-report); None = absent
    cached_tokens: int | None = None
    error: str | None = None  # None = success
    done: bool = False  # the stream ended with `data: [DONE]` (an in-band error is explicit only then)
    pool: str | None = None  # the router's X-Router-Pool answer header (None straight to a server)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class LevelRun:
    """All records of one load level against one target, and the wall time it took."""

    records: list[RequestRecord]
    duration: float  # first request start to last request end (bench_serving's benchmark_duration)
    concurrency: int | None = None
    request_rate: float | None = None
    accept_length: float | None = None


# ---- prompts -------------------------------------------------------------------------------------

def _prompt_from_obj(obj: object, where: str) -> Prompt:
    if not isinstance(obj, dict):
        raise BenchInputError(f"{where}: expected a JSON object with 'messages' or 'prompt'")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in msgs
        ):
            raise BenchInputError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        return Prompt(messages=msgs)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise BenchInputError(f"{where}: 'prompt' must be a non-empty string")
        return Prompt(prompt=obj["prompt"])
    raise BenchInputError(f"{where}: expected a JSON object with 'messages' or 'prompt'")


def parse_prompts_jsonl(text: str, name: str) -> list[Prompt]:
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchInputError(f"{name}:{lineno}: not valid JSON ({exc.msg})") from None
        prompts.append(_prompt_from_obj(obj, f"{name}:{lineno}"))
    if not prompts:
        raise BenchInputError(f"{name}: no prompts found")
    return prompts


def load_prompts(spec: str) -> list[Prompt]:
    """`coding`, `general`, or a path to a JSONL file of {"messages": [...]} / {"prompt": "..."} lines."""
    if spec in BUILTIN_PROMPT_SETS:
        text = resources.files("bench").joinpath("prompts", f"{spec}.jsonl").read_text(encoding="utf-8")
        return parse_prompts_jsonl(text, f"{spec}.jsonl")
    path = Path(spec)
    if not path.is_file():
        raise BenchInputError(
            f"--prompts {spec!r}: not a built-in set ({', '.join(BUILTIN_PROMPT_SETS)}) nor a readable file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchInputError(f"--prompts {spec!r}: cannot read ({exc})") from None
    return parse_prompts_jsonl(text, str(path))


def build_body(p: Prompt, model: str, max_tokens: int, extra: dict | None) -> bytes:
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": True,
                  "stream_options": {"include_usage": True}}
    if p.messages is not None:
        body["messages"] = p.messages
    else:
        body["prompt"] = p.prompt
    if extra:
        body.update(extra)
    return json.dumps(body).encode()


# ---- one streaming request -----------------------------------------------------------------------

def _has_text(event: bytes) -> bool:
    """True when a chunk carries generated text. Byte search, no JSON parse: the client's CPU is
    shared with the servers under test on small machines."""
    i = event.find(b'"content"')
    if i < 0:
        i = event.find(b'"text"')
        if i < 0:
            return False
        i += 6
    else:
        i += 9
    n = len(event)
    while i < n and event[i] in b" :":
        i += 1
    return not (event.startswith(b'""', i) or event.startswith(b"null", i))


def _error_message(obj: object) -> str:
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:200]
        if isinstance(err, str):
            return err[:200]
    return str(obj)[:200]


def _content(payload: bytes) -> str:
    """The generated text a chunk carries (chat delta content or completions text)."""
    try:
        choices = json.loads(payload).get("choices") or []
    except ValueError:
        return ""
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    delta = c.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else c.get("text")
    return text if isinstance(text, str) else ""


async def stream_one(session: aiohttp.ClientSession, url: str, path: str, body: bytes,
                     limit_s: float, text: list[str] | None = None) -> RequestRecord:
    """One streaming request. With `text`, the generated text's pieces are appended to it (each chunk is
    then parsed as JSON: a multi-turn client sends the reply back in the next turn)."""
    rec = RequestRecord(start=time.perf_counter())
    clock = time.perf_counter
    usage = None
    saw_done = False
    try:
        async with asyncio.timeout(limit_s):
            async with session.post(url + path, data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                rec.pool = resp.headers.get("X-Router-Pool")
                if resp.status != 200:
                    text = await resp.text(errors="replace")
                    try:
                        msg = _error_message(json.loads(text))
                    except ValueError:
                        msg = text.strip()[:200] or resp.reason or ""
                    rec.error = f"HTTP {resp.status}: {msg}"
                    rec.end = clock()
                    return rec
                buf = b""
                # iter_any: one read may hold many SSE events; they all arrived at the same instant.
                async for data in resp.content.iter_any():
                    now = clock()
                    buf += data
                    if b"\n\n" not in buf:
                        continue
                    *events, buf = buf.split(b"\n\n")
                    for ev in events:
                        if not ev.startswith(b"data:"):
                            continue  # comments / keep-alives / event: lines
                        payload = ev[5:].strip()
                        if payload == b"[DONE]":
                            saw_done = True
                            break
                        if payload.startswith(b'{"error"') or (
                            b'"error"' in payload and b'"choices"' not in payload
                        ):
                            try:
                                rec.error = "stream error: " + _error_message(json.loads(payload))
                            except ValueError:
                                rec.error = "stream error: " + payload[:200].decode(errors="replace")
                            continue
                        if _has_text(payload):
                            if rec.ttft is None:
                                rec.ttft = now - rec.start
                            rec.chunk_times.append(now)
                            if text is not None:
                                text.append(_content(payload))
                        if b'"usage"' in payload and b'"usage":null' not in payload:
                            try:
                                u = json.loads(payload).get("usage")
                            except ValueError:
                                u = None
                            if isinstance(u, dict):
                                usage = u
                    if saw_done:
                        break
                if saw_done:
                    # Read to the end so the connection goes back to the pool: leaving unread bytes closes
                    # it, and a new connection per request costs the server an accept (slow under load).
                    await resp.content.read()
    except TimeoutError:
        rec.error = f"timeout after {limit_s:g}s"
    except aiohttp.ClientConnectorError as exc:
        rec.error = f"cannot connect to {url}: {exc.os_error.strerror if exc.os_error else exc}"
    except (aiohttp.ClientError, ConnectionError) as exc:
        rec.error = f"connection error: {type(exc).__name__}: {exc}"[:200]
    rec.end = clock()
    rec.done = saw_done
    if rec.error is None and not saw_done:
        rec.error = "stream ended without [DONE]"
    if usage is not None:
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        rec.usage_reported = True
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            rec.cached_tokens = details["cached_tokens"]
    else:
        rec.output_tokens = len(rec.chunk_times)
    if rec.error is None and rec.ttft is None:
        rec.error = "no tokens received"
    return rec


# ---- load shapes ---------------------------------------------------------------------------------

@dataclass
class LoadSpec:
    """How one level is bounded: a request count, a duration (seconds of wall time), or both."""

    url: str
    prompts: list[Prompt]
    model: str = "default"
    max_tokens: int = 512
    requests: int | None = None
    duration: float | None = None
    timeout: float = 600.0  # per request, wall seconds
    level_timeout: float = 1800.0  # hard cap per level: outstanding requests are cancelled and failed
    extra_body: dict | None = None
    seed: int = 0


Progress = Callable[[int, int | None], None]  # (finished, expected or None)


def _session(limit: int) -> aiohttp.ClientSession:
    conn = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, force_close=False,
                                enable_cleanup_closed=False)
    return aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None),
                                 auto_decompress=False)


def _bodies(spec: LoadSpec) -> tuple[list[tuple[str, bytes]], int]:
    bodies = [(p.path, build_body(p, spec.model, spec.max_tokens, spec.extra_body)) for p in spec.prompts]
    return bodies, random.Random(spec.seed).randrange(len(bodies))


async def run_closed(spec: LoadSpec, concurrency: int, progress: Progress | None = None) -> LevelRun:
    """`concurrency` clients; each sends its next request when its last one ends."""
    if spec.requests is None and spec.duration is None:
        raise BenchInputError("a level needs --requests-per-level or --duration-per-level")
    bodies, offset = _bodies(spec)
    counter = itertools.count()
    records: list[RequestRecord] = []
    url = spec.url.rstrip("/")
    t0 = time.perf_counter()

    async def client(session: aiohttp.ClientSession) -> None:
        while True:
            if spec.duration is not None and time.perf_counter() - t0 >= spec.duration:
                return
            i = next(counter)
            if spec.requests is not None and i >= spec.requests:
                return
            path, body = bodies[(offset + i) % len(bodies)]
            rec = await stream_one(session, url, path, body, spec.timeout)
            records.append(rec)
            if progress:
                progress(len(records), spec.requests)

    n_clients = concurrency if spec.requests is None else min(concurrency, spec.requests)
    async with _session(concurrency) as session:
        tasks = [asyncio.create_task(client(session)) for _ in range(n_clients)]
        await _bounded_wait(tasks, spec.level_timeout, records)
    return _level(records, concurrency=concurrency)


async def run_open(spec: LoadSpec, rate: float, progress: Progress | None = None) -> LevelRun:
    """Poisson arrivals at `rate` requests per second (wall clock), regardless of completions."""
    if spec.requests is None and spec.duration is None:
        raise BenchInputError("a level needs --requests-per-level or --duration-per-level")
    bodies, offset = _bodies(spec)
    rng = random.Random(spec.seed)
    records: list[RequestRecord] = []
    url = spec.url.rstrip("/")

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        path, body = bodies[(offset + i) % len(bodies)]
        records.append(await stream_one(session, url, path, body, spec.timeout))
        if progress:
            progress(len(records), spec.requests)

    async with _session(0) as session:
        tasks: list[asyncio.Task] = []
        t0 = time.perf_counter()
        next_at = t0
        for i in itertools.count():
            if spec.requests is not None and i >= spec.requests:
                break
            if spec.duration is not None and next_at - t0 >= spec.duration:
                break
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, i)))
            next_at += rng.expovariate(rate)
        await _bounded_wait(tasks, spec.level_timeout, records)
    return _level(records, request_rate=rate)


async def wait_bounded(tasks: list[asyncio.Task], limit: float) -> int:
    """Wait at most `limit` seconds for `tasks`, then cancel the rest and wait for them to unwind; returns how
    many were cancelled."""
    _, pending = await asyncio.wait(tasks, timeout=limit)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    return len(pending)


def cancelled(n: int, limit: float) -> list[RequestRecord]:
    """Records for `n` requests the level's time limit cut: counted as failed, never dropped."""
    now = time.perf_counter()
    return [RequestRecord(start=now, end=now, error=f"cancelled: level time limit {limit:g}s") for _ in range(n)]


async def _bounded_wait(tasks: list[asyncio.Task], limit: float, records: list[RequestRecord]) -> None:
    # A cancelled request never produced a record; count it as failed rather than drop it.
    records.extend(cancelled(await wait_bounded(tasks, limit), limit))


def _level(records: list[RequestRecord], **kw) -> LevelRun:
    if records:
        duration = max(r.end for r in records) - min(r.start for r in records)
    else:
        duration = 0.0
    return LevelRun(records=records, duration=duration, **kw)


# ---- target probes -------------------------------------------------------------------------------

async def check_reachable(url: str, wait_s: float = 5.0) -> None:
    """Fail fast with one clear line when nothing listens at `url`."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=wait_s)) as s:
            async with s.get(url.rstrip("/") + "/v1/models") as resp:
                await resp.read()
    except aiohttp.ClientConnectorError as exc:
        reason = exc.os_error.strerror if exc.os_error else str(exc)
        raise BenchInputError(f"target {url} is unreachable: {reason}") from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BenchInputError(f"target {url} is unreachable: {type(exc).__name__} {exc}".strip()) from None


async def read_accept_length(url: str, wait_s: float = 5.0) -> float | None:
    """SGLang's avg_spec_accept_length from /server_info; None when the target has none."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=wait_s)) as s:
            async with s.get(url.rstrip("/") + "/server_info") as resp:
                if resp.status != 200:
                    return None
                info = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    states = info.get("internal_states") if isinstance(info, dict) else None
    if isinstance(states, list) and states and isinstance(states[0], dict):
        v = states[0].get("avg_spec_accept_length")
        if isinstance(v, int | float):
            return float(v)
    return None
