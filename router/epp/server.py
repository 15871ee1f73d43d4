"""The ext_proc gRPC service of the endpoint picker (Gateway API Inference Extension EPP protocol v1.0.0), full
duplex on both bodies, plus the gRPC health services; decisions come from router.epp.decide."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from router.body import with_usage
from router.epp.decide import Decider, Pick, Request
from router.errors import Failure, PayloadTooLarge, RouterError
from router.headers import BACKEND_HEADER, POOL_HEADER, SLO_TPOT_HEADER, SLO_TTFT_HEADER, predicted_headers
from router.streaming import scan_usage, split_events, usage_view

log = logging.getLogger("router.epp")

# The protocol's names (endpoint-picker-protocol.md).
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# Where Envoy puts the response attribute deploy/envoy/envoy.yaml asks for: the upstream that answered.
ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
UPSTREAM_ADDRESS = "upstream.address"
CODE_DETAILS = "response.code_details"
VIA_UPSTREAM = "via_upstream"  # the code details of an answer the backend sent
# Envoy's code details of an answer it made itself after a failed attempt, by what they contain (first match),
# as the failure serve would have seen (router.errors.Failure).
ENVOY_FAILURES: tuple[tuple[str, Failure], ...] = (
    ("connection_timeout", Failure.CONNECT_TIMEOUT),
    ("local_connection_failure", Failure.LOCAL),  # Envoy's own socket failed: not the backend's fault
    ("connection_failure", Failure.REFUSED),
    ("idle_timeout", Failure.IDLE_TIMEOUT),
    ("response_timeout", Failure.FIRST_BYTE_TIMEOUT),
    ("per_try_timeout", Failure.FIRST_BYTE_TIMEOUT),
    ("upstream_reset", Failure.DISCONNECTED),
)
HEALTH_SERVICES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
# An answer not streamed is kept this far to read its usage (a longer one goes unread); and an SSE event held
# back until its end comes, at most this long.
USAGE_SCAN_BYTES = 1 << 20
# epp_response_body: the picker reads every response chunk (stream) or the response headers and the stream's end
# only (none); Envoy's own report of its response body mode (ProcessingRequest.protocol_config) wins.
STREAM, NONE = "stream", "none"
BODY_NONE = processing_mode_pb2.ProcessingMode.NONE


def _header(headers: base_pb2.HeaderMap, name: str) -> str | None:
    for h in headers.headers:
        if h.key == name:
            return (h.raw_value or h.value.encode()).decode("latin-1")
    return None


def _set_headers(pairs: Iterable[tuple[str, str]]) -> pb.HeaderMutation:
    return pb.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                   append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        for k, v in pairs])


def _metadata_value(req: pb.ProcessingRequest, namespace: str, key: str):
    ns = req.metadata_context.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    value = ns.fields[key]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values]
    return value.string_value if kind == "string_value" else None


def _served(req: pb.ProcessingRequest) -> str | None:
    """The endpoint that answered: the protocol's metadata when the data plane sets it, else the upstream
    address attribute Envoy reports."""
    got = _metadata_value(req, LB_NAMESPACE, SERVED)
    if isinstance(got, str) and got:
        return got
    attrs = req.attributes.get(ATTRIBUTES_NAMESPACE)
    if attrs is not None and UPSTREAM_ADDRESS in attrs.fields:
        return attrs.fields[UPSTREAM_ADDRESS].string_value or None
    return None


def code_details(req: pb.ProcessingRequest) -> str | None:
    """Envoy's response code details (None: not sent): via_upstream for the backend's own answer, else why Envoy
    answered itself."""
    attrs = req.attributes.get(ATTRIBUTES_NAMESPACE)
    if attrs is None or CODE_DETAILS not in attrs.fields:
        return None
    return attrs.fields[CODE_DETAILS].string_value


def failure_of(details: str) -> Failure | None:
    """How the attempt failed when Envoy answered itself after trying the backend (a refused or reset connection,
    an upstream timeout); None when the details name no such failure."""
    if not details.startswith("upstream_"):
        return None
    return next((f for marker, f in ENVOY_FAILURES if marker in details), None)


def immediate(err: RouterError) -> pb.ProcessingResponse:
    """The error as the client sees it: OpenAI-style JSON with the error's status (and Retry-After when shed)."""
    headers = [("content-type", "application/json")]
    retry_after = getattr(err, "retry_after_s", None)
    if retry_after is not None:
        headers.append(("retry-after", str(retry_after)))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=err.status),
        headers=_set_headers(headers),
        body=json.dumps(err.body()).encode(), details=f"epp_{err.code}"))


class Exchange:
    """One ext_proc stream (one HTTP request): what it read so far and its pick, ended exactly once.
    `response_body`: STREAM (every response chunk comes here) or NONE (the headers and the stream's end only)."""

    def __init__(self, decider: Decider, max_body_bytes: int, response_body: str = STREAM) -> None:
        self.decider = decider
        self.max_body_bytes = max_body_bytes
        self.watch_body = response_body == STREAM
        self.envoy_disagrees = False  # Envoy reported another response body mode than the setting (it won)
        self.pinned: str | None = None
        self.slo: tuple[str | None, str | None] = (None, None)  # the latency target headers (router.slo)
        self.subset: list[str] | None = None
        self.body = bytearray()
        self.pick: Pick | None = None
        self.status = 0
        self.sse = False
        self.strip = False  # the usage chunk was asked for by the picker, not the client: it goes no further
        self.done = False  # a stream's [DONE] came
        self.tail = b""  # an SSE event not complete yet
        self.answer = bytearray()  # an answer not streamed, up to USAGE_SCAN_BYTES, for its usage

    def handle(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            if req.HasField("protocol_config"):
                # What Envoy will send decides how the answer is read (and whether usage may be asked for).
                sends_body = req.protocol_config.response_body_mode != BODY_NONE
                self.envoy_disagrees = sends_body != self.watch_body
                self.watch_body = sends_body
            headers = req.request_headers.headers
            self.pinned = _header(headers, POOL_HEADER.lower())
            self.slo = (_header(headers, SLO_TTFT_HEADER), _header(headers, SLO_TPOT_HEADER))
            subset = _metadata_value(req, SUBSET_NAMESPACE, SUBSET)
            self.subset = subset if isinstance(subset, list) else None
            if req.request_headers.end_of_stream:
                # A POST without a body is an empty body (a 400); a GET has none to read.
                return self._decide(b"" if _header(headers, ":method") == "POST" else None, [])
            return []  # the headers' answer waits for the body: the pick needs the prompt
        if kind == "request_body":
            self.body += req.request_body.body
            if len(self.body) > self.max_body_bytes:
                return [immediate(PayloadTooLarge(f"request body is over the {self.max_body_bytes}-byte limit"))]
            if req.request_body.end_of_stream or req.request_body.end_of_stream_without_message:
                return self._decide(bytes(self.body), [])
            return []
        if kind == "request_trailers":
            done = [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
            return done if self.pick is not None else self._decide(bytes(self.body), done)
        if kind == "response_headers":
            return [self._response_headers(req)]
        if kind == "response_body":
            return [self._response_body(req.response_body)]
        if kind == "response_trailers":
            self._end()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _decide(self, body: bytes | None, after: list[pb.ProcessingResponse]) -> list[pb.ProcessingResponse]:
        got = self.decider.decide(Request(body, self.pinned, self.subset, *self.slo))
        if isinstance(got, RouterError):
            return [immediate(got)]
        self.pick = got
        # What the request's body told is read here, once: the open request keeps neither copy of its body.
        head, got.head, self.body = got.head, None, bytearray()
        value = ",".join(got.endpoints)
        set_headers = [(DESTINATION, value)]
        if got.forecast is not None:  # the prediction, for the backend's logs (and back on the answer below)
            set_headers += [(k.lower(), v) for k, v in predicted_headers(got.forecast).items()]
        if body and self.watch_body and head is not None and head.streamed and not head.wants_usage:
            # The usage chunk tells the tokens the lease ran for (as in serve); the client still gets none. Not
            # when the picker sees no response body: it could not take the chunk out.
            body, self.strip = with_usage(body, head), True
            set_headers.append(("content-length", str(len(body))))
        # The same value in the header and the metadata, as the protocol requires.
        meta = struct_pb2.Struct()
        meta.update({LB_NAMESPACE: {DESTINATION: value}})
        out = [pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                header_mutation=_set_headers(set_headers))),
            dynamic_metadata=meta)]
        if body:
            out.append(pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=body, end_of_stream=not after))))))
        return out + after

    def _response_headers(self, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        headers = req.response_headers.headers
        self.status = int(_header(headers, ":status") or 0)
        self.sse = (_header(headers, "content-type") or "").startswith("text/event-stream")
        mutation = None
        if self.pick is not None:
            served = _served(req)
            if served:
                self.pick.served(served)
            details = code_details(req)
            if details is None or details == VIA_UPSTREAM:
                self.pick.answered(self.status)
            elif (failure := failure_of(details)) is not None:
                self.pick.answered(self.status, failure)
            # else Envoy answered without trying the backend (no_healthy_upstream: an address it could not use):
            # no attempt of the backend's to count.
            answer = [(POOL_HEADER, self.pick.pool), (BACKEND_HEADER, self.pick.url)]
            if self.pick.forecast is not None:
                answer += list(predicted_headers(self.pick.forecast).items())
            mutation = _set_headers(answer)
            if not self.watch_body:
                # No first token will be seen: the headers stand for it (the prefill it queued is done).
                self.pick.answering()
            elif not self.sse:
                self.pick.sent()
            if req.response_headers.end_of_stream:
                self._end()
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=mutation)))

    def _response_body(self, body: pb.HttpBody) -> pb.ProcessingResponse:
        data = body.body
        end = body.end_of_stream or body.end_of_stream_without_message
        pick = self.pick
        if pick is not None and self.sse:
            # Whole events go on (a chunk's unfinished tail with the next one), so the usage chunk can be dropped.
            events, self.tail = split_events(self.tail + data)
            if end or len(self.tail) > USAGE_SCAN_BYTES:  # the last bytes, or no event end in sight: on as is
                events, self.tail = events + self.tail, b""
            if events:
                if not pick.ended:
                    pick.chunk(events.count(b"\ndata:") + events.startswith(b"data:"))
                events = scan_usage(events, pick.usage, strip=self.strip)
                self.done = self.done or events.rstrip().endswith(b"data: [DONE]")
            data = events
        elif pick is not None and not pick.ended and len(self.answer) + len(data) <= USAGE_SCAN_BYTES:
            self.answer += data
        if end:
            self._end()
        # Full duplex: each chunk is answered at once (a stream's with its whole events).
        return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=data, end_of_stream=end)))))

    def _end(self) -> None:
        pick = self.pick
        if pick is None or pick.ended:
            return
        # Without the body nothing tells a stream cut mid-way from a finished one: it ends as finished.
        complete = self.done if self.sse and self.watch_body else True
        if not self.sse and self.status == 200 and b'"usage"' in self.answer:
            pick.usage.take(usage_view(bytes(self.answer)))
        pick.end(200 <= self.status < 300 and complete)

    def closed(self) -> None:
        """The ext_proc stream ended (Envoy closed it, reset or cancelled it): the lease ends here, once. With the
        body watched the answer's own end came first, so this is an abandoned answer; without it this is the
        answer's end (Envoy keeps the stream open until the HTTP stream ends: response_trailer_mode SEND), a
        success when the response headers came with a 2xx."""
        if self.pick is None or self.pick.ended:
            return
        if not self.watch_body and self.status:
            self._end()
        else:
            self.pick.end(False)


class Processor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, decider: Decider, max_body_bytes: int, response_body: str = STREAM) -> None:
        self.decider = decider
        self.max_body_bytes = max_body_bytes
        self.response_body = response_body
        self.warned = False  # the setting disagreeing with Envoy's body mode is said once
        self.open: set[Exchange] = set()

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        ex = Exchange(self.decider, self.max_body_bytes, self.response_body)
        self.open.add(ex)
        try:
            async for req in request_iterator:
                for resp in ex.handle(req):
                    yield resp
                if ex.envoy_disagrees and not self.warned:
                    self.warned = True
                    log.warning("epp_response_body is %s but Envoy %s the response body: read as Envoy sends it "
                                "(deploy/envoy/envoy%s.yaml goes with %s)", self.response_body,
                                "sends" if ex.watch_body else "does not send",
                                "-headers" if self.response_body == NONE else "", self.response_body)
        finally:
            self.open.discard(ex)
            ex.closed()


async def set_health(health: HealthServicer, ready: bool) -> None:
    await health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in HEALTH_SERVICES[1:]:
        await health.set(name, status)


def build_server(decider: Decider, max_body_bytes: int, response_body: str = STREAM
                 ) -> tuple[grpc.aio.Server, Processor, HealthServicer]:
    # No SO_REUSEPORT: a second picker on the same port must fail to start, not share the port unnoticed.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    processor = Processor(decider, max_body_bytes, response_body)
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    return server, processor, health
