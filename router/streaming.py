"""SSE framing of the upstream byte stream and the usage scan (the one chunk the router ever parses)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


class _UsageView(msgspec.Struct):
    """The two keys the usage scan reads from a response object; the rest is skipped, not built."""

    usage: Any = None
    choices: Any = None


_USAGE = msgspec.json.Decoder(_UsageView)


def usage_view(data: bytes) -> _UsageView | None:
    """usage and choices of one JSON object (a whole response or one SSE event), None if it is not one."""
    try:
        return _USAGE.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None


def split_events(buf: bytes) -> tuple[bytes, bytes]:
    """Complete SSE events and the unfinished tail."""
    end = buf.rfind(b"\n\n")
    if end >= 0:
        return buf[:end + 2], buf[end + 2:]
    end = buf.rfind(b"\r\n\r\n")
    if end >= 0:
        return buf[:end + 4], buf[end + 4:]
    return b"", buf


@dataclass(slots=True)
class Usage:
    prompt: int = 0
    completion: int = 0
    seen: bool = False
    cached: int | None = None  # usage.prompt_tokens_details.cached_tokens (SGLang --enable-cache-report)

    def take(self, view: _UsageView | None) -> None:
        usage = view.usage if view is not None else None
        if isinstance(usage, dict):
            p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
            self.prompt = p if isinstance(p, int) else self.prompt
            self.completion = c if isinstance(c, int) else self.completion
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            self.cached = cached if isinstance(cached, int) and cached >= 0 else self.cached
            self.seen = True


def scan_usage(events: bytes, usage: Usage, strip: bool) -> bytes:
    """Record usage from the usage chunk; drop that chunk when the client did not ask for it."""
    if b'"prompt_tokens"' not in events:  # the cheap check: most chunks never get parsed
        return events
    sep = b"\r\n\r\n" if b"\r\n\r\n" in events else b"\n\n"
    kept = []
    for ev in events.split(sep):
        if b'"prompt_tokens"' in ev and ev.startswith(b"data:"):
            view = usage_view(ev[5:])
            if view is not None:
                usage.take(view)
                if strip and not view.choices:
                    continue
        kept.append(ev)
    return sep.join(kept)
