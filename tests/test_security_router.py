"""Security properties against a recording backend: allowlist, credentials, constant-time key check, limits."""
from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from tests.test_fuzz_stack import (
    ALLOWED_UPSTREAM,
    BACKEND_KEY,
    CLIENT_KEY,
    build_request,
    raw_request,
    run_stack,
)

GOOD = [(b"Content-Type", b"application/json"), (b"Authorization", b"Bearer " + CLIENT_KEY.encode())]
CHAT_BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


@pytest.fixture(scope="module")
def stack():
    s, stop = run_stack(api_key=CLIENT_KEY, max_body_bytes=4096, max_headers=20, max_header_bytes=1024,
                        client_timeout=1.0)
    yield s
    stop()


def generation_requests(stack) -> list:
    return [r for r in stack.recorded if r.path != "/health"]


@pytest.mark.parametrize("target", [
    "/_sim/faults", "/_sim/stats", "/metrics/../_sim/faults", "/v1/chat/completions/../../_sim/faults",
    "/v1/%2e%2e/_sim/stats", "/v1/chat/completions%2f..%2f..%2f_sim%2ffaults", "//_sim/stats",
    "/v1/chat/completions/..%2f..%2fgenerate", "/v1/%252e%252e/generate", "/generate", "/server_info",
    "/v1/loads", "/flush_cache", "/v1/chat/completions/extra", "/v1/./completions/..;/x", "/V1/completions",
    "/v1/chat/completions%00", "http://127.0.0.1:1/_sim/faults", "/%5c..%5c_sim/stats",
])
@pytest.mark.parametrize("method", [b"POST", b"GET", b"DELETE", b"PUT"])
def test_no_path_off_the_allowlist_reaches_a_backend(stack, target, method):
    before = len(stack.recorded)
    status, got = raw_request(stack, build_request(method, target.encode(), GOOD, CHAT_BODY))
    assert status is not None and 400 <= status < 500, got[:300]
    new = [r for r in stack.recorded[before:] if r.path != "/health"]
    # Whatever the router made of the path, only its fixed upstream paths can ever be reached.
    assert all((r.method, r.path) in ALLOWED_UPSTREAM for r in new), new


def test_generation_goes_to_the_fixed_path_without_the_clients_query(stack):
    before = len(stack.recorded)
    status, _ = raw_request(stack, build_request(b"POST", b"/v1/chat/completions?x=/../_sim/faults&y=1", GOOD,
                                                 CHAT_BODY))
    assert status == 200
    (fwd,) = [r for r in stack.recorded[before:] if r.path != "/health"]
    assert (fwd.method, fwd.path, fwd.body) == ("POST", "/v1/chat/completions", CHAT_BODY)


def test_client_credentials_and_headers_never_reach_a_backend(stack):
    before = len(stack.recorded)
    extra = [(b"Cookie", b"session=" + CLIENT_KEY.encode()), (b"X-Api-Key", CLIENT_KEY.encode()),
             (b"Proxy-Authorization", b"Basic " + CLIENT_KEY.encode()), (b"X-Forwarded-For", b"1.2.3.4")]
    for path in (b"/v1/chat/completions", b"/v1/completions"):
        status, got = raw_request(stack, build_request(b"POST", path, GOOD + extra, CHAT_BODY))
        assert status == 200, got[:300]
    status, _ = raw_request(stack, build_request(b"GET", b"/v1/models", GOOD + extra, None))
    assert status == 200
    seen = stack.recorded[before:]
    assert {r.path for r in seen} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    for r in seen:
        assert CLIENT_KEY not in repr(r.headers) and "1.2.3.4" not in repr(r.headers)
        assert r.headers.get("Authorization") == f"Bearer {BACKEND_KEY}"


def test_without_a_backend_key_no_authorization_is_sent_upstream():
    s, stop = run_stack(api_key=CLIENT_KEY, speculative_api_key=None)
    try:
        status, _ = raw_request(s, build_request(b"POST", b"/v1/chat/completions", GOOD, CHAT_BODY))
        assert status == 200
        assert all("Authorization" not in r.headers for r in s.recorded)
    finally:
        stop()


@pytest.mark.parametrize("auth", [b"", b"Bearer ", b"Bearer wrong", b"Bearer " + CLIENT_KEY[:-1].encode(),
                                  b"Bearer " + CLIENT_KEY.encode() + b"x", b"Basic " + CLIENT_KEY.encode(),
                                  CLIENT_KEY.encode(), b"Bearer " + CLIENT_KEY.upper().encode(),
                                  b"Bearer \xff\xfe"])
def test_wrong_keys_are_401_and_never_forwarded(stack, auth):
    """Regression (Bearer + bytes that are not UTF-8): the key check raised and the router answered 500."""
    before = len(stack.recorded)
    headers = [(b"Content-Type", b"application/json")] + ([(b"Authorization", auth)] if auth else [])
    status, got = raw_request(stack, build_request(b"POST", b"/v1/chat/completions", headers, CHAT_BODY))
    assert status == 401, got[:300]
    assert b'"invalid_api_key"' in got
    assert generation_requests_since(stack, before) == []


def generation_requests_since(stack, before: int) -> list:
    return [r for r in stack.recorded[before:] if r.path != "/health"]


def test_body_limit_is_413_by_length_and_when_chunked_and_never_forwarded(stack):
    before = len(stack.recorded)
    big = b'{"model":"m","p":"' + b"x" * 5000 + b'"}'
    status, got = raw_request(stack, build_request(b"POST", b"/v1/chat/completions", GOOD, big))
    assert status == 413 and b'"request_too_large"' in got
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(big[i:i + 1000]), big[i:i + 1000]) for i in range(0, len(big), 1000))
    data = build_request(b"POST", b"/v1/chat/completions", GOOD + [(b"Transfer-Encoding", b"chunked")],
                         chunked + b"0\r\n\r\n", content_length=False)
    status, got = raw_request(stack, data)
    assert status == 413
    assert generation_requests_since(stack, before) == []


def test_header_count_and_size_limits(stack):
    before = len(stack.recorded)
    many = GOOD + [(f"X-H{i}".encode(), b"v") for i in range(25)]
    status, _ = raw_request(stack, build_request(b"POST", b"/v1/chat/completions", many, CHAT_BODY))
    assert status is not None and 400 <= status < 500
    status, _ = raw_request(stack, build_request(b"POST", b"/v1/chat/completions",
                                                 GOOD + [(b"X-Big", b"v" * 2000)], CHAT_BODY))
    assert status is not None and 400 <= status < 500
    status, _ = raw_request(stack, build_request(b"POST", b"/v1/chat/completions?" + b"q" * 2000, GOOD, CHAT_BODY))
    assert status is not None and 400 <= status < 500
    assert generation_requests_since(stack, before) == []


def test_a_stalled_body_upload_gets_408(stack):
    """Regression: a client that stopped sending its body held the handler for ever (no read timeout)."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
           b"Authorization: Bearer " + CLIENT_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"model\""
    t0 = time.monotonic()
    status, got = raw_request(stack, head, timeout=5)
    assert status == 408 and b'"request_timeout"' in got
    assert time.monotonic() - t0 < 4


def test_a_connection_that_never_finishes_its_headers_is_closed(stack):
    """Regression: aiohttp's default keep-alive timeout (an hour) let slow-loris clients hold sockets."""
    with socket.create_connection((stack.host, stack.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        t0 = time.monotonic()
        assert sock.recv(100) == b""  # closed by the router, not by our 5 s timeout
        assert time.monotonic() - t0 < 4


def test_metric_labels_never_come_from_requests(stack):
    body = b'{"model":"attacker-chosen-label","messages":[{"role":"user","content":"hi"}]}'
    assert raw_request(stack, build_request(b"POST", b"/v1/chat/completions", GOOD, body))[0] == 200
    assert raw_request(stack, build_request(b"POST", b"/v1/attacker-path", GOOD, body))[0] == 404
    with urllib.request.urlopen(stack.router_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    assert "attacker" not in text


def test_metrics_can_be_served_only_on_a_separate_address():
    s, stop = run_stack(metrics_host="127.0.0.1", metrics_port=0)
    try:
        status, _ = raw_request(s, build_request(b"GET", b"/metrics", [], None))
        assert status == 404
        from router.state import STATE

        url = s.app[STATE].metrics_url
        assert url and url != s.router_url
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            assert r.status == 200 and b"router_inflight_requests" in r.read()
    finally:
        stop()
