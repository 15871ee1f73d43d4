"""Hypothesis fuzzing of the router's HTTP surface: no 5xx for bad input, no crash, nothing forwarded off the allowlist."""
from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.test_fuzz_stack import (
    CLIENT_KEY,
    FUZZ_SEED,
    FuzzStack,
    build_request,
    examples,
    raw_request,
    run_stack,
)

BODY_LIMIT = 64 * 1024
FUZZ = settings(max_examples=examples(120), deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def fuzz():
    stack, stop = run_stack(api_key=CLIENT_KEY, max_body_bytes=BODY_LIMIT, max_headers=30, max_header_bytes=2048,
                            client_timeout=2.0)
    yield stack
    try:
        # After everything: the router is alive, holds no lease and logged no error of its own.
        with urllib.request.urlopen(stack.router_url + "/health", timeout=5) as r:
            assert r.status == 200
        deadline = time.monotonic() + 3
        while any(stack.inflight().values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(stack.inflight().values()) == {0}
        assert stack.leaks() == []
        assert stack.errors.router_records() == []
        report(stack)
    finally:
        stop()


def report(stack: FuzzStack) -> None:
    """FUZZ_REPORT=path appends the counts (inputs tried, statuses seen) for docs/RELIABILITY.md."""
    path = os.environ.get("FUZZ_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"inputs": stack.sent, "statuses": {str(k): v for k, v in stack.statuses.items()},
                                "forwarded": len([r for r in stack.recorded if r.path != "/health"]),
                                "leaks": len(stack.leaks())}) + "\n")


def check(stack: FuzzStack, status: int | None, got: bytes) -> None:
    assert status is not None, f"no HTTP answer: {got[:200]!r}"
    assert status < 500, got[:400]
    assert stack.leaks() == [], stack.leaks()[:3]


# ---- strategies ----------------------------------------------------------------------------------

TOKEN = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~", min_size=1, max_size=12)
METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "CONNECT",
                           "PROPFIND"]) | TOKEN
SEGMENTS = st.sampled_from(["v1", "chat", "completions", "models", "health", "ready", "metrics", "_sim", "faults",
                            "stats", "..", ".", "%2e%2e", "%2E%2E", "%2f", "%2F", "%252e%252e", "..%2f", "%2e%2e%2f",
                            "%00", "%ff", "%c0%ae", "", "generate", "server_info", "v1%2fchat", "~", "%E2%80%AE",
                            "..;", "\\..\\", "%5c..%5c"])
RAW_SEGMENT = st.binary(max_size=10).map(lambda b: bytes(c for c in b if c not in b" \r\n\t#?"))
PATHS = st.one_of(
    st.lists(SEGMENTS, min_size=1, max_size=6).map(lambda s: "/" + "/".join(s)),
    st.lists(SEGMENTS | RAW_SEGMENT.map(lambda b: b.decode("latin-1")), min_size=1, max_size=5)
    .map(lambda s: "/" + "/".join(s)),
    st.sampled_from(["/v1/chat/completions/../../_sim/faults", "/v1/%2e%2e/_sim/stats", "//_sim/stats",
                     "/v1/chat/completions%2f..%2f..%2fmetrics", "/v1/./chat/completions", "/v1//completions",
                     "http://127.0.0.1:1/_sim/faults", "*", "/v1/chat/completions?x=../../_sim",
                     "/v1/chat/completions/", "/V1/CHAT/COMPLETIONS", "/v1/chat/completions;/../_sim/stats"]),
).flatmap(lambda p: st.sampled_from(["", "?a=1", "?path=/_sim/faults", "?%ff=%00"]).map(lambda q: p + q))
CONTENT_TYPES = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", "application/json; charset=latin-1", "",
                                 "application/json\x00", "*/*"])
HEADER_NAMES = st.sampled_from(["Authorization", "X-Router-Pool", "Content-Encoding", "Accept", "Cookie",
                                "X-Forwarded-For", "Expect", "Accept-Encoding", "X-Api-Key", "Range",
                                "Upgrade", "TE", "Trailer", "Origin"]) | TOKEN
HEADER_VALUES = st.binary(max_size=60).map(lambda b: bytes(c for c in b if c not in b"\r\n"))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                    max_leaves=20)
MAX_TOKENS = st.one_of(st.integers(), st.just(10**40), st.just(-1), st.floats(allow_nan=False), st.text(max_size=5),
                       st.none(), JSON)


def chat_like(draw_max_tokens):
    return st.fixed_dictionaries(
        {"model": st.text(max_size=10) | JSON,
         "messages": st.just([{"role": "user", "content": "hi"}]) | JSON,
         "max_tokens": draw_max_tokens},
        optional={"stream": st.booleans() | JSON, "stream_options": JSON | st.just({"include_usage": True}),
                  "n": st.integers(), "temperature": st.floats(allow_nan=True) | JSON}).map(
        lambda d: json.dumps(d, allow_nan=True).encode())


def nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    if kind == "dict":
        return b'{"a":' * depth + b"1" + b"}" * depth
    return b'{"messages":' + b"[" * depth + b"]" * depth + b"}"


BODIES = st.one_of(
    chat_like(MAX_TOKENS),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=300),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from([b'{"model":"\xff\xfe","messages":[]}', b'{"model":"m"\xc3\x28}', b"\xef\xbb\xbf{}",
                     b'{"stream":true,"model":"m"}', b'{"stream":true,"stream_options":1}', b"null", b"[]",
                     b'"str"', b"1e999999", b'{"a":1,"a":2}', b'{"max_tokens":1' + b"0" * 5000 + b"}"]),
    st.tuples(st.integers(1, 60000), st.sampled_from(["list", "dict", "messages"])).map(lambda t: nested(*t)),
    st.integers(BODY_LIMIT - 10, BODY_LIMIT * 3).map(lambda n: b'{"p":"' + b"x" * n + b'"}'),
)
GEN_PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions"])


GOOD_AUTH = [(b"Authorization", b"Bearer " + CLIENT_KEY.encode())]


def auth_header() -> st.SearchStrategy:
    fuzzed = st.tuples(st.sampled_from([b"Bearer ", b"bearer  ", b"Basic ", b""]), HEADER_VALUES).map(
        lambda t: [(b"Authorization", t[0] + t[1])])
    # Half the inputs carry the right key, so bad bodies and headers get past authentication.
    return st.just(GOOD_AUTH) | fuzzed | st.just(GOOD_AUTH) | st.sampled_from([[], GOOD_AUTH,
                            [(b"Authorization", b"Bearer wrong")], [(b"Authorization", CLIENT_KEY.encode())]])


def chunked(body: bytes, size: int) -> bytes:
    size = max(1, size)
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


# ---- properties ----------------------------------------------------------------------------------

@FUZZ
@seed(FUZZ_SEED)
@given(method=METHODS, path=PATHS, auth=auth_header())
def test_fuzz_methods_and_paths(fuzz, method, path, auth):
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}' if method == "POST" else None
    headers = [(b"Content-Type", b"application/json"), *auth]
    status, got = raw_request(fuzz, build_request(method.encode(), path.encode("latin-1"), headers, body))
    check(fuzz, status, got)


@FUZZ
@seed(FUZZ_SEED)
@given(path=GEN_PATHS, body=BODIES, ctype=CONTENT_TYPES, auth=auth_header(), mode=st.sampled_from(["length", "chunked"]),
       size=st.integers(1, 5000))
def test_fuzz_bodies(fuzz, path, body, ctype, auth, mode, size):
    headers = [(b"Content-Type", ctype.encode("latin-1")), *auth]
    if mode == "chunked":
        headers.append((b"Transfer-Encoding", b"chunked"))
        data = build_request(b"POST", path.encode(), headers, chunked(body, size), content_length=False)
    else:
        data = build_request(b"POST", path.encode(), headers, body)
    status, got = raw_request(fuzz, data)
    check(fuzz, status, got)
    if len(body) > BODY_LIMIT:
        # 413 unless an earlier check refuses it first (a bad header is 400, a bad key 401).
        assert status in (400, 401, 413)


@FUZZ
@seed(FUZZ_SEED)
@given(path=GEN_PATHS | PATHS, extra=st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=40),
       long_value=st.integers(0, 5000), auth=auth_header())
def test_fuzz_headers(fuzz, path, extra, long_value, auth):
    headers = [(b"Content-Type", b"application/json"), *auth]
    headers += [(n.encode(), v) for n, v in extra]
    if long_value:
        headers.append((b"X-Long", b"v" * long_value))
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
    status, got = raw_request(fuzz, build_request(b"POST", path.encode("latin-1"), headers, body))
    check(fuzz, status, got)
    if len(headers) + 4 > 30 or long_value > 2048:
        assert 400 <= status < 500


@FUZZ
@seed(FUZZ_SEED)
@given(garbage=st.binary(min_size=1, max_size=400))
def test_fuzz_raw_bytes_on_the_socket(fuzz, garbage):
    status, got = raw_request(fuzz, garbage + b"\r\n\r\n")
    if garbage.strip(b"\r\n"):
        # Anything but blank lines is a request line, however broken: it gets an answer (400), not a close.
        assert status is not None and status < 500, got[:300]
    else:
        # Only blank lines: HTTP/1.1 skips them before a request line, so the router waits, then closes.
        assert status is None and got == b""
    assert fuzz.leaks() == []


@settings(max_examples=min(examples(6), 40), deadline=None, database=None)  # each example takes ~1 s
@seed(FUZZ_SEED)
@given(pieces=st.integers(2, 5), delay=st.floats(0.05, 0.3))
def test_fuzz_slow_uploads_complete(fuzz, pieces, delay):
    body = b'{"model":"m","messages":[{"role":"user","content":"' + b"y" * 3000 + b'"}]}'
    head = build_request(b"POST", b"/v1/chat/completions",
                         [(b"Content-Type", b"application/json"),
                          (b"Authorization", b"Bearer " + CLIENT_KEY.encode())], body)
    cut = len(head) - len(body)
    step = -(-len(body) // pieces)
    rest = [(body[i:i + step], delay) for i in range(0, len(body), step)]
    status, got = raw_request(fuzz, head[:cut], timeout=10, chunks=rest)
    assert status == 200, got[:300]
    # The last generation request the backend got is this one, byte for byte (health probes interleave).
    assert [r for r in fuzz.recorded if r.path == "/v1/chat/completions"][-1].body == body
