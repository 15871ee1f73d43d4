"""SGLang 0.5.23's OpenAI wire format: request validation and the exact bytes of each response and chunk."""
from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

SGLANG_VERSION = "0.5.23"


def dumps(obj: Any) -> str:
    """Compact JSON as pydantic/msgspec/orjson write it (no spaces, UTF-8 kept)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# ---- requests (what SGLang's protocol.py accepts, reduced to what the simulator uses) -------------
class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = "default"
    max_tokens: int | None = Field(default=None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int = 1
    ignore_eos: bool = False
    seed: int | None = None

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("the simulator supports n=1 only")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if isinstance(p, dict))
        return self.content or ""


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompt_text(self) -> str:
        return "\n".join(f"{m.role}: {m.text()}" for m in self.messages)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's and SGLang's default for completions

    def limit(self) -> int | None:
        return self.max_tokens

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("the simulator supports one prompt per request")
            return self.prompt[0]
        return " ".join(str(t) for t in self.prompt)


# ---- errors (serving_base.create_error_response, http_server exception handlers) --------------------
def error_body(message: str, err_type: str, code: int) -> str:
    return dumps({"object": "error", "message": message, "type": err_type, "param": None, "code": code})


def streaming_error(message: str, err_type: str, code: int) -> str:
    # serving_base.create_streaming_error_response uses json.dumps with default separators
    err = {"object": "error", "message": message, "type": err_type, "param": None, "code": code}
    return json.dumps({"error": err})


def _details(cached: int | None) -> dict | None:
    # UsageProcessor: PromptTokensDetails(cached_tokens=...) only with --enable-cache-report (else None)
    return None if cached is None else {"cached_tokens": cached}


def usage(prompt: int, completion: int, cached: int | None = None) -> dict:
    """`cached`: the request's cached prompt tokens when the server runs with --enable-cache-report, else None."""
    return {
        "prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
        "prompt_tokens_details": _details(cached), "reasoning_tokens": 0, "completion_tokens_details": None,
    }


# ---- chat (serving_chat.py, sse_utils.build_sse_content) --------------------------------------------
def chat_chunk(rid: str, created: int, model: str, *, role: str | None = None, content: str | None = None,
               finish_reason: str | None = None, matched_stop: int | str | None = None) -> bytes:
    delta: dict[str, Any] = {"reasoning_content": None}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    chunk = {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                     "matched_stop": matched_stop}],
    }
    return f"data: {dumps(chunk)}\n\n".encode()


class ContentChunks:
    """The per-token content chunk of one stream, pre-rendered around its only changing field (hot path)."""

    def __init__(self, rid: str, created: int, model: str, *, chat: bool) -> None:
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model}
        lead = dumps(head)[:-1]
        if chat:
            self._pre = f'data: {lead},"choices":[{{"index":0,"delta":{{"reasoning_content":null,"content":'.encode()
            self._post = b'},"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n'
        else:
            self._pre = f'data: {lead},"choices":[{{"index":0,"text":'.encode()
            self._post = b',"logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}\n\n'

    def __call__(self, text: str) -> bytes:
        return self._pre + encode_basestring(text).encode() + self._post


def chat_usage_chunk(rid: str, created: int, model: str, prompt: int, completion: int,
                     cached: int | None = None) -> bytes:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [], "usage": usage(prompt, completion, cached)}
    return f"data: {dumps(chunk)}\n\n".encode()


def chat_response(rid: str, created: int, model: str, text: str, finish_reason: str,
                  matched_stop: int | str | None, prompt: int, completion: int, cached: int | None = None) -> str:
    return dumps({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None},
                     "logprobs": None, "finish_reason": finish_reason, "matched_stop": matched_stop}],
        "usage": usage(prompt, completion, cached), "metadata": {"weight_version": "default"},
    })


# ---- completions (serving_completions.py) ----------------------------------------------------------
def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None = None,
                     matched_stop: int | str | None = None) -> bytes:
    chunk = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                     "matched_stop": matched_stop}],
        "usage": None,
    }
    return f"data: {dumps(chunk)}\n\n".encode()


def completion_usage_chunk(rid: str, created: int, model: str, prompt: int, completion: int,
                           cached: int | None = None) -> bytes:
    # SGLang dumps this one with exclude_none=True
    u = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    if cached is not None:
        u["prompt_tokens_details"] = _details(cached)
    u["reasoning_tokens"] = 0
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
             "usage": u}
    return f"data: {dumps(chunk)}\n\n".encode()


def completion_response(rid: str, created: int, model: str, text: str, finish_reason: str,
                        matched_stop: int | str | None, prompt: int, completion: int,
                        cached: int | None = None) -> str:
    return dumps({
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                     "matched_stop": matched_stop}],
        "usage": usage(prompt, completion, cached), "metadata": {"weight_version": "default"},
    })


DONE = b"data: [DONE]\n\n"
