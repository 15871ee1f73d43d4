"""The simulated SGLang HTTP server: SimConfig, SimServer, the OpenAI routes, native routes and /_sim admin."""
from __future__ import annotations

import asyncio
import json
import random
import socket
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

from aiohttp import web
from pydantic import ValidationError

from bench.sim import protocol as P
from bench.sim import specadaptive
from bench.sim.engine import Engine, QueueFull, SimRequest, build_request, chat_key, tokenize
from bench.sim.faults import Faults
from bench.sim.gpu import Gpu
from bench.sim.metrics import SimMetrics
from bench.sim.profiles import Profile, load_profile

JSON = "application/json"


@dataclass
class SimConfig:
    """Everything one simulated server needs; times in seconds."""

    profile: Profile = field(default_factory=lambda: load_profile("baseline-tp8"))
    model: str | None = None  # served model name; SGLang defaults it to the model path
    speedup: float = 1.0
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    max_total_tokens: int | None = None  # KV capacity in tokens (default: the profile's)
    startup_delay: float = 0.0  # wall seconds during which /health answers 503
    seed: int = 0
    faults: Faults = field(default_factory=Faults)
    disable_radix_cache: bool = False  # SGLang --disable-radix-cache: no prefix cache, 0 cached tokens
    enable_cache_report: bool = False  # SGLang --enable-cache-report: usage.prompt_tokens_details.cached_tokens
    # SGLang --speculative-adaptive-config (a JSON file; None: its default table); adaptive profiles only
    speculative_adaptive_config: str | None = None

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError("speedup must be > 0")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError("max_total_tokens must be >= 1")
        if self.startup_delay < 0:
            raise ValueError("startup_delay must be >= 0")

    @property
    def served_model_name(self) -> str:
        return self.model or self.profile.model_path


def _content_type_error() -> web.Response:
    # http_server.validate_json_request raises RequestValidationError; its handler renders a 400
    errs = [{"loc": ["header", "content-type"],
             "msg": "Unsupported Media Type: Only 'application/json' is allowed", "type": "value_error"}]
    return _error(str(errs), "Bad Request", 400)


def _error(message: str, err_type: str, code: int) -> web.Response:
    return web.Response(text=P.error_body(message, err_type, code), status=code, content_type=JSON)


class SimServer:
    """One simulated SGLang server on 127.0.0.1 (see docs/ARCHITECTURE.md for the contract)."""

    def __init__(self, cfg: SimConfig, gpu: Gpu | None = None) -> None:
        """`gpu`: GPUs shared with other servers of this process (co-location); None = this server's own."""
        self.cfg = cfg
        self.profile = cfg.profile
        self.gpu = gpu
        self.engine = Engine(cfg.profile, speedup=cfg.speedup, max_running_requests=cfg.max_running_requests,
                             max_queued_requests=cfg.max_queued_requests, max_total_tokens=cfg.max_total_tokens,
                             gpu=gpu, radix_cache=not cfg.disable_radix_cache,
                             adaptive_config=specadaptive.load_config(cfg.speculative_adaptive_config)
                             if cfg.speculative_adaptive_config else None)
        if gpu is not None:
            gpu.members.append(self)
        self.engine.on_finish = self._on_finish
        self.metrics = SimMetrics(cfg.served_model_name)
        self.faults = cfg.faults
        self.faults_injected: dict[str, int] = {}
        self._fault_rng = random.Random(cfg.seed)
        self._host = "127.0.0.1"
        self._port = 0
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None
        self._started_at = 0.0
        self._started_wall = 0.0
        self._tasks: set[asyncio.Task] = set()
        self._closing = asyncio.Event()
        self._ready_event = asyncio.Event()
        self.app = self._build_app()

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._host = host
        self._started_at = time.monotonic()
        self._started_wall = time.time()
        self.engine.start()
        asyncio.get_running_loop().call_later(self.cfg.startup_delay, self._ready_event.set)
        # handler_cancellation: a client that goes away cancels its handler, which aborts the request
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=0.5)
        await self._runner.setup()
        self._port = port
        await self.start_listener()
        if self.faults.refuse_for > 0:
            self._spawn(self._refuse(self.faults.refuse_for))
        return self._port

    async def start_listener(self) -> None:
        if self._site is not None or self._runner is None:
            return
        sock = socket.socket(socket.AF_INET6 if ":" in self._host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError:
            sock.close()
            raise
        sock.listen(1024)
        sock.setblocking(False)
        self._port = sock.getsockname()[1]
        # aiohttp re-listens with backlog 128 unless told: a burst of 2,000 connects would overflow it
        self._site = web.SockSite(self._runner, sock, backlog=4096)
        await self._site.start()

    async def stop_listener(self) -> None:
        """Refuse new connections (the port stays reserved for start_listener); open ones carry on."""
        if self._site is not None:
            site, self._site = self._site, None
            await site.stop()

    async def close(self) -> None:
        self._closing.set()
        for task in list(self._tasks):
            task.cancel()
        await self.engine.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self._site = None

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _count_fault(self, kind: str) -> None:
        self.faults_injected[kind] = self.faults_injected.get(kind, 0) + 1
        self.metrics.faults.labels(kind=kind).inc()

    async def _refuse(self, seconds: float) -> None:
        self._count_fault("refuse")
        await self.stop_listener()
        try:
            await asyncio.sleep(seconds)
        finally:
            if not self._closing.is_set():
                await self.start_listener()
                self.faults = self.faults.merged({"refuse_for": 0.0})

    def _ready(self) -> bool:
        return time.monotonic() - self._started_at >= self.cfg.startup_delay

    # ---- app ----------------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/ready", self.ready)
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/models/{model:.+}", self.model_card)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/metrics", self.metrics_handler)
        r.add_get("/_sim/faults", self.faults_get)
        r.add_post("/_sim/faults", self.faults_post)
        r.add_delete("/_sim/faults", self.faults_delete)
        r.add_get("/_sim/stats", self.stats)
        r.add_post("/_sim/speedup", self.speedup_post)
        r.add_get("/_sim/drift", self.drift_get)
        r.add_post("/_sim/drift", self.drift_post)
        r.add_delete("/_sim/drift", self.drift_delete)
        return app

    # ---- generation ---------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, P.ChatRequest, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, P.CompletionRequest, chat=False)

    async def _parse(self, request: web.Request, model: type) -> P.ChatRequest | P.CompletionRequest | web.Response:
        media = request.headers.get("content-type", "").lower().split(";", 1)[0].strip()
        if media != JSON:
            return _content_type_error()
        raw = await request.read()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            errs = [{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error", "input": {},
                     "ctx": {"error": str(exc).split(":")[0]}}]
            return _error(str(errs), "Bad Request", 400)
        if not isinstance(data, dict):
            errs = [{"type": "model_attributes_type", "loc": ("body",),
                     "msg": "Input should be a valid dictionary or object to extract fields from"}]
            return _error(str(errs), "Bad Request", 400)
        try:
            body = model.model_validate(data)
            body.prompt_text()
        except ValidationError as exc:
            errs = [{"type": e["type"], "loc": ("body", *e["loc"]), "msg": e["msg"]} for e in exc.errors()]
            return _error(str(errs), "Bad Request", 400)
        except ValueError as exc:
            return _error(str(exc), "BadRequest", 400)
        return body

    def _prompt_key(self, body, chat: bool) -> list:
        """The prompt's tokens (what the prefix cache matches); their count is usage.prompt_tokens."""
        if chat:
            # a chat template adds a few tokens per message and for the assistant turn
            return chat_key([(m.role, m.text()) for m in body.messages])
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], int):
            return list(body.prompt)
        return tokenize(body.prompt_text())

    async def _generate(self, request: web.Request, model: type, *, chat: bool) -> web.StreamResponse:
        body = await self._parse(request, model)
        if isinstance(body, web.Response):
            return body
        faults = self.faults
        if faults.error_rate > 0 and self._fault_rng.random() < faults.error_rate:
            self._count_fault("error")
            status = faults.error_status
            if status == 503:
                return _error("The server is temporarily unavailable (injected fault).", "503", 503)
            return _error("Internal server error: injected fault", "InternalServerError", 500)
        if faults.hang:
            self._count_fault("hang")
            await self._park()
        if not self._ready():
            await self._ready_event.wait()  # SGLang holds requests until the model has loaded
        prompt_text = body.prompt_text()
        key = self._prompt_key(body, chat)
        req = build_request(
            uuid.uuid4().hex, prompt_text, len(key), profile=self.profile,
            seed=self.cfg.seed if body.seed is None else body.seed, max_tokens=body.limit(),
            stop=body.stop_list(), ignore_eos=body.ignore_eos, stream=body.stream, key=key,
        )
        try:
            self.engine.submit(req)
        except QueueFull as exc:
            self.engine.requests_total += 1
            self.engine.aborted_total += 1
            self.metrics.num_aborted.labels(**self.metrics.tok).inc()
            if body.stream:
                # SGLang starts the stream, then reports the scheduler's abort inside it
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
                await resp.prepare(request)
                await resp.write(f"data: {P.streaming_error(str(exc), 'SERVICE_UNAVAILABLE', 503)}\n\n".encode())
                await resp.write(P.DONE)
                await resp.write_eof()
                return resp
            return _error(str(exc), "503", 503)
        try:
            if body.stream:
                return await self._stream(request, body, req, chat, faults)
            return await self._whole(request, body, req, chat, faults)
        finally:
            if not req.done:
                self.engine.abort(req)

    async def _whole(self, request: web.Request, body, req: SimRequest, chat: bool, faults: Faults):
        finished = False
        while not finished:
            finished = (await req.outbox.get_all())[-1][1]
        created = int(time.time())  # SGLang stamps a whole response when it builds it
        if faults.drop_after_chunks is not None:
            self._count_fault("drop")
            await self._drop(request)
        if faults.stall_after_chunks is not None:
            self._count_fault("stall")
            await self._park()
        build = P.chat_response if chat else P.completion_response
        text = build(req.rid, created, body.model, req.text, req.finish_reason, req.matched_stop,
                     req.prompt_tokens, req.completion_tokens, self._cached_report(req))
        return web.Response(text=text, content_type=JSON)

    async def _drop(self, request: web.Request) -> None:
        if request.transport is not None:
            request.transport.abort()
        await self._park()

    async def _park(self) -> None:
        """Send nothing more: wait until the client leaves (which cancels us) or the server closes."""
        await self._closing.wait()
        raise asyncio.CancelledError

    async def _stream(self, request: web.Request, body, req: SimRequest, chat: bool, faults: Faults):
        created = int(time.time())
        model = body.model
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        stall, drop = faults.stall_after_chunks, faults.drop_after_chunks
        out: list[bytes] = []  # the SSE events of one wake-up, sent in one write (one syscall)
        sent = 0

        async def flush() -> None:
            if not out:
                return
            if not resp.prepared:
                # SGLang sends the headers with the first chunk, after prefill
                await resp.prepare(request)
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            await resp.write(data)

        async def emit(data: bytes) -> None:
            nonlocal sent
            if drop is not None and sent >= drop:
                await flush()
                self._count_fault("drop")
                await self._drop(request)
            if stall is not None and sent >= stall:
                await flush()
                self._count_fault("stall")
                await self._park()
            out.append(data)
            sent += 1

        content = P.ContentChunks(req.rid, created, model, chat=chat)
        first = True
        finished = False
        while not finished:
            # normally one step's output; several when this handler fell behind the engine
            for piece, finished in await req.outbox.get_all():
                if chat:
                    if first:
                        await emit(P.chat_chunk(req.rid, created, model, role="assistant", content=""))
                    if piece:
                        await emit(content(piece))
                    if finished:
                        await emit(P.chat_chunk(req.rid, created, model, finish_reason=req.finish_reason,
                                                matched_stop=req.matched_stop))
                elif finished:
                    await emit(P.completion_chunk(req.rid, created, model, piece, req.finish_reason,
                                                  req.matched_stop))
                elif piece or first:
                    await emit(content(piece))
                first = False
            if not finished:
                await flush()
        if include_usage:
            build = P.chat_usage_chunk if chat else P.completion_usage_chunk
            await emit(build(req.rid, created, model, req.prompt_tokens, req.completion_tokens,
                             self._cached_report(req)))
        await emit(P.DONE)
        await flush()
        await resp.write_eof()
        return resp

    def _cached_report(self, req: SimRequest) -> int | None:
        """usage.prompt_tokens_details.cached_tokens: only with --enable-cache-report, as in SGLang."""
        return req.cached_tokens if self.cfg.enable_cache_report else None

    def _on_finish(self, req: SimRequest) -> None:
        m, k = self.metrics, self.cfg.speedup
        streaming = "true" if req.stream else "false"
        labels = {**m.tok, "is_streaming": streaming}
        m.num_requests.labels(**labels).inc()
        m.prompt_tokens.labels(**labels).inc(req.prompt_tokens)
        if req.cached_tokens > 0:  # the radix cache is the device tier: SGLang's cache_source="device"
            m.cached_tokens.labels(**m.tok, cache_source="device").inc(req.cached_tokens)
        m.generation_tokens.labels(**labels).inc(req.generated)
        if req.state == "aborted":
            m.num_aborted.labels(**m.tok).inc()
        end = req.finished_at or time.monotonic()
        # latencies are reported in simulated seconds, as the real server would measure them
        m.e2e.labels(**labels).observe((end - req.arrival) * k)
        if req.admitted_at is not None:
            m.queue_time.labels(**m.sched).observe((req.admitted_at - req.arrival) * k)
        if req.first_token_at is not None:
            m.ttft.labels(**labels).observe((req.first_token_at - req.arrival) * k)
            itl = m.itl.labels(**m.tok)
            for gap in req.itl:
                itl.observe(gap * k)

    # ---- native endpoints ---------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        faults = self.faults
        if faults.health_delay > 0:
            self._count_fault("health_delay")
            await asyncio.sleep(faults.health_delay)
        if faults.health_status is not None:
            self._count_fault("health_status")
            return web.Response(status=faults.health_status)
        return web.Response(status=200 if self._ready() else 503)

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._ready() else 503)

    def _card(self) -> dict:
        name = self.cfg.served_model_name
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
                "parent": None, "max_model_len": self.profile.context_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.Response(text=P.dumps({"object": "list", "data": [self._card()]}), content_type=JSON)

    async def model_card(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if model != self.cfg.served_model_name:
            err = {"message": f"The model '{model}' does not exist", "type": "invalid_request_error",
                   "param": "model", "code": "model_not_found"}
            return web.Response(text=P.dumps({"error": err}), status=404, content_type=JSON)
        return web.Response(text=P.dumps(self._card()), content_type=JSON)

    async def model_info(self, request: web.Request) -> web.Response:
        p = self.profile
        info = {
            "model_path": p.model_path, "served_model_name": self.cfg.served_model_name,
            "tokenizer_path": p.model_path, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "load_format": "auto", "reasoning_parser": None,
            "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "kimi_k25", "architectures": ["KimiK25ForCausalLM"],
        }
        return web.Response(text=P.dumps(info), content_type=JSON)

    def _max_running(self) -> int:
        return self.engine.max_running

    async def server_info(self, request: web.Request) -> web.Response:
        p, e = self.profile, self.engine
        state = {"last_gen_throughput": e.gen_throughput(), "memory_usage": {"weight": 0.0, "kvcache": 0.0},
                 "effective_max_running_requests_per_dp": self._max_running()}
        if p.speculative:
            state["avg_spec_accept_length"] = e.avg_accept_length()
        info = {
            "model_path": p.model_path, "served_model_name": self.cfg.served_model_name,
            "tokenizer_path": p.model_path, "host": self._host, "port": self._port, "tp_size": p.tp_size,
            "dp_size": 1, "pp_size": 1, "context_length": p.context_len,
            "max_running_requests": self.cfg.max_running_requests,
            "max_queued_requests": self.cfg.max_queued_requests,
            "max_total_tokens": e.max_total_tokens, "enable_metrics": True, "random_seed": self.cfg.seed,
            "disable_radix_cache": self.cfg.disable_radix_cache, "enable_cache_report": self.cfg.enable_cache_report,
            "page_size": 1, "chunked_prefill_size": p.chunked_prefill_size,
            "speculative_algorithm": "EAGLE3" if p.speculative else None,
            "speculative_num_steps": p.speculative_num_steps if p.speculative else None,
            "speculative_eagle_topk": p.speculative_eagle_topk if p.speculative else None,
            "speculative_num_draft_tokens": p.speculative_num_draft_tokens if p.speculative else None,
            "speculative_adaptive": p.speculative_adaptive,
            "speculative_adaptive_config": self.cfg.speculative_adaptive_config,
            "startup_time": self._started_wall, "internal_states": [state], "version": P.SGLANG_VERSION,
            "frontend": "python", "simulator_profile": p.name, "simulator_speedup": self.cfg.speedup,
        }
        return web.Response(text=P.dumps(info), content_type=JSON)

    async def loads(self, request: web.Request) -> web.StreamResponse:
        p, e = self.profile, self.engine
        include = request.query.get("include")
        sections = {s.strip() for s in include.split(",")} if include else None
        valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if sections is not None and not sections <= valid:
            msg = f"Invalid include sections: {sections - valid}. Valid options: {sorted(valid)}"
            return _error(msg, "400", 400)
        used = e.used_tokens()
        load = {
            "timestamp": time.time(), "dp_rank": 0, "num_running_reqs": e.num_running,
            "num_waiting_reqs": e.num_queued,
            # SGLang estimates it from the recent (15 s) cache miss rate when the queue was not prefix-matched
            "num_waiting_uncached_tokens": int(sum(r.prompt_tokens for r in e.waiting)
                                               * (1.0 - e.recent_cache_hit_rate())),
            "num_used_tokens": used, "num_total_tokens": used, "num_active_tokens": used,
            "num_prealloc_ready_tokens": 0, "max_total_num_tokens": e.max_total_tokens,
            "max_running_requests": self._max_running(), "token_usage": e.token_usage(),
            "gen_throughput": e.gen_throughput(), "cache_hit_rate": round(e.last_cache_hit_rate, 4),
            "utilization": min(1.0, e.num_running / self._max_running()),
            "total_prefill_uncached_tokens": e.prefill_computed_total, "total_prefill_busy_us": 0,
            "decode_moments": None,
        }
        everything = sections is None or "all" in sections
        if sections != {"core"}:
            if p.speculative and (everything or "spec" in sections):
                length = e.avg_accept_length()
                load["speculative"] = {"accept_length": length, "accept_rate": e.avg_accept_rate()}
            if everything or "queues" in sections:
                load["queues"] = {"waiting": e.num_queued, "grammar": 0, "paused": 0, "retracted": 0,
                                  "prealloc_ready": 0}
        if request.query.get("format") == "prometheus":
            lines = []
            for key, value in load.items():
                items = value.items() if isinstance(value, dict) else [(None, value)]
                prefix = {"speculative": "spec"}.get(key, key)
                for sub, v in items:
                    if isinstance(v, (int, float)) and key != "dp_rank":
                        name = f"sglang_{prefix}_{sub}" if sub else f"sglang_{key}"
                        lines += [f"# TYPE {name} gauge", f'{name}{{dp_rank="0"}} {v}']
            return web.Response(text="\n".join(lines) + "\n", content_type="text/plain",
                                charset="utf-8")
        out = {"timestamp": datetime.now(UTC).isoformat(), "version": P.SGLANG_VERSION,
               "accelerator": None, "num_accelerators": p.tp_size, "loads": [load]}
        return web.Response(text=P.dumps(out), content_type=JSON)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        m, e, p = self.metrics, self.engine, self.profile
        s = m.sched
        # SGLang refreshes these every few decode steps; reading them live gives the same picture
        m.num_running_reqs.labels(**s).set(e.num_running)
        m.num_queue_reqs.labels(**s).set(e.num_queued)
        m.gen_throughput.labels(**s).set(e.gen_throughput())
        m.token_usage.labels(**s).set(e.token_usage())
        m.cache_hit_rate.labels(**s).set(e.last_cache_hit_rate)
        m.utilization.labels(**s).set(min(1.0, e.num_running / self._max_running()))
        length = e.avg_accept_length() if p.speculative else 0.0
        m.spec_accept_length.labels(**s).set(length)
        m.spec_accept_rate.labels(**s).set(e.avg_accept_rate())
        delta = e.verify_calls_total - getattr(self, "_verify_seen", 0)
        if delta:
            m.spec_verify_calls.labels(**s).inc(delta)
            self._verify_seen = e.verify_calls_total
        return web.Response(body=m.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ---- admin --------------------------------------------------------------------------------
    async def faults_get(self, request: web.Request) -> web.Response:
        return web.json_response(self.faults.model_dump())

    async def faults_post(self, request: web.Request) -> web.Response:
        try:
            update = await request.json()
            if not isinstance(update, dict):
                raise ValueError("body must be a JSON object")
            new = self.faults.merged(update)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            return _error(f"invalid fault {where}: {first['msg']}", "BadRequestError", 400)
        except ValueError as exc:
            return _error(f"invalid body: {exc}", "BadRequestError", 400)
        self.faults = new
        if "refuse_for" in update and new.refuse_for > 0:
            self._spawn(self._refuse(new.refuse_for))
        return web.json_response(self.faults.model_dump())

    async def faults_delete(self, request: web.Request) -> web.Response:
        self.faults = Faults()
        return web.json_response(self.faults.model_dump())

    async def speedup_post(self, request: web.Request) -> web.Response:
        """Change --speedup at run time (a sweep gives each load level the speed the machine can carry)."""
        try:
            body = await request.json()
            value = float(body["speedup"])
            if not value > 0:
                raise ValueError
        except (ValueError, TypeError, KeyError):
            return _error('body must be {"speedup": K} with K > 0', "BadRequestError", 400)
        # co-located servers run on one clock: the change applies to every server on these GPUs
        for server in self.gpu.members if self.gpu is not None else [self]:
            server.cfg.speedup = value
            server.engine.speedup = value
        return web.json_response({"speedup": value})

    async def drift_get(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.drift())

    async def drift_post(self, request: web.Request) -> web.Response:
        """Change the acceptance from now on: {"accept_length": L} and/or {"prompt_mix": "coding"|"chat"}."""
        try:
            update = await request.json()
            if not isinstance(update, dict) or not update:
                raise ValueError('body must be a JSON object like {"accept_length": 1.6} or {"prompt_mix": "chat"}')
            return web.json_response(self.engine.set_drift(update))
        except ValueError as exc:  # json.JSONDecodeError included
            return _error(f"invalid drift: {exc}", "BadRequestError", 400)

    async def drift_delete(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.set_drift({"accept_length": None, "prompt_mix": None}))

    async def stats(self, request: web.Request) -> web.Response:
        e = self.engine
        c = e.cache
        return web.json_response({
            "running": e.num_running, "queued": e.num_queued, "requests_total": e.requests_total,
            "completed_total": e.completed_total, "aborted_total": e.aborted_total,
            "faults_injected": dict(self.faults_injected),
            "max_total_tokens": e.max_total_tokens,
            # simulated seconds: GPU time of this server's steps, and time its steps waited for a co-located
            # server's (0 when alone); gpu_switches counts context switches on the shared GPUs
            "busy_s": round(e.busy_s, 6), "gpu_wait_s": round(e.gpu_wait_s, 6),
            "colocated_with": [m.url for m in self.gpu.members if m is not self] if self.gpu is not None else [],
            "gpu_switches": self.gpu.switches if self.gpu is not None else 0,
            "drift": {"accept_length": e.drift_accept_length, "prompt_mix": e.drift_prompt_mix},
            "drift_changes": e.drift_changes,
            # the prefix cache: prompt tokens of admitted requests, how many of them were cached, the tree
            "prompt_tokens_total": e.prompt_tokens_admitted, "cached_tokens_total": e.cached_tokens_total,
            "cache_hit_ratio": round(e.cached_tokens_total / e.prompt_tokens_admitted, 6)
            if e.prompt_tokens_admitted else 0.0,
            "radix_cache": None if c is None else {
                "tokens": c.total_size, "evictable_tokens": c.evictable_size, "protected_tokens": c.protected_size,
                "evicted_tokens_total": c.evicted_total},
            "reserved_tokens": e.reserved_tokens,
            # --speculative-adaptive: the draft steps of the last decode step and each batch-size slot's state
            "draft_steps": e.last_draft_steps,
            "adaptive": e.adaptive.state() if e.adaptive is not None else None,
        })
