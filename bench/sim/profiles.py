"""Simulator profiles: the engine-model parameters of one SGLang deployment, and loading them from JSON."""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from router.curves import interpolate

PROFILE_DIR = Path(__file__).parent / "profiles"

# SGLang silently caps an EAGLE server at 48 running requests unless --max-running-requests is set.
EAGLE_DEFAULT_MAX_RUNNING = 48


class ProfileError(ValueError):
    """A profile name or file that cannot be used; the message is one line for the CLI."""


class Profile(BaseModel):
    """Parameters of the batching model; every time is in milliseconds of simulated (GPU) time."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    speculative: bool = False
    # decode step of a running batch of n requests: a + b*n + q*n^2 (ms)
    decode_a_ms: float = Field(gt=0)
    decode_b_ms: float = Field(ge=0)
    decode_q_ms: float = 0.0  # may be negative (a concave curve) as long as the step keeps growing
    # optional measured shape: [[n, ms], ...]; when set, steps interpolate these points instead of a+b*n+q*n^2
    step_points_ms: list[tuple[int, float]] | None = None
    # prefill added to the step that admits new requests: p0 + p1 * new prompt tokens (ms)
    prefill_base_ms: float = Field(default=0.0, ge=0)
    prefill_ms_per_token: float = Field(default=0.0, ge=0)
    # attention's share of prefill, which grows with context: ms per million causal query-key pairs a prefill
    # chunk computes (a chunk of t tokens after s earlier ones makes t*s + t(t+1)/2; docs/SIMULATOR.md)
    prefill_attention_ms_per_mpair: float = Field(default=0.0, ge=0)
    # attention reads the KV cache: each step also costs this much per 1000 tokens held by the decoding batch
    kv_ms_per_ktoken: float = Field(default=0.0, ge=0)
    # prompt tokens prefilled per step at most (SGLang --chunked-prefill-size): a longer prompt takes several
    chunked_prefill_size: int = Field(default=8192, ge=1)
    max_running_requests: int = Field(default=1024, ge=1)
    # speculative decoding: mean accepted tokens per step (incl. the bonus token) by prompt kind
    accept_length_general: float = Field(default=1.0, ge=1.0)
    accept_length_coding: float = Field(default=1.0, ge=1.0)
    # spread (standard deviation) of each request's own mean accept length around its class mean
    accept_length_spread: float = Field(default=0.0, ge=0)
    speculative_num_steps: int = Field(default=2, ge=1)
    speculative_eagle_topk: int = 4
    speculative_num_draft_tokens: int = 16
    # SGLang --speculative-adaptive (topk 1): the draft steps are chosen per decode step by batch size
    # (bench.sim.specadaptive); each candidate step count has its own step curve, 0 = no drafting but the
    # draft's extend pass. The accept lengths above are at speculative_num_steps; a request's per-token
    # acceptance (a topk-1 chain's) is the same at every step count.
    speculative_adaptive: bool = False
    adaptive_step_points_ms: dict[int, list[tuple[int, float]]] | None = None
    # what the server reports about itself
    model_path: str = "moonshotai/Kimi-K2.5"
    tp_size: int = 8
    context_len: int = 262144
    max_total_num_tokens: int = 1_000_000
    eos_token_id: int = 163586
    # output length a prompt "naturally" stops at (EOS) unless max_tokens or ignore_eos cut it
    natural_output_tokens: tuple[int, int] = (600, 1600)
    fitted_from: str | None = None

    @model_validator(mode="after")
    def _check(self) -> Profile:
        if self.speculative:
            cap = self.speculative_num_steps + 1
            for kind in ("general", "coding"):
                value = getattr(self, f"accept_length_{kind}")
                if value > cap:
                    raise ValueError(f"accept_length_{kind}={value} exceeds num_steps+1={cap}")
        pts = self.step_points_ms
        if pts is not None:
            if len(pts) < 2 or any(n2 <= n1 for (n1, _), (n2, _) in zip(pts, pts[1:], strict=False)):
                raise ValueError("step_points_ms needs 2+ points with increasing n")
            if any(ms <= 0 for _, ms in pts):
                raise ValueError("step_points_ms must be positive")
        if self.speculative_adaptive:
            if not self.speculative or self.speculative_eagle_topk != 1:
                raise ValueError("speculative_adaptive needs speculative true and speculative_eagle_topk 1 "
                                 "(SGLang supports topk 1 only)")
            curves = self.adaptive_step_points_ms or {}
            if not curves or any(k < 0 for k in curves):
                raise ValueError("speculative_adaptive needs adaptive_step_points_ms: {steps: [[n, ms], ...]}")
            for k, kp in curves.items():
                if len(kp) < 2 or any(n2 <= n1 for (n1, _), (n2, _) in zip(kp, kp[1:], strict=False)) \
                        or any(ms <= 0 for _, ms in kp):
                    raise ValueError(f"adaptive_step_points_ms[{k}] needs 2+ positive points with increasing n")
        elif self.adaptive_step_points_ms is not None:
            raise ValueError("adaptive_step_points_ms is only for speculative_adaptive profiles")
        cap = self.max_running_requests
        if pts is None and self.decode_b_ms + 2 * self.decode_q_ms * cap < 0 or self.step_ms(cap) <= 0:
            raise ValueError("decode step must stay positive and non-decreasing up to max_running_requests")
        lo, hi = self.natural_output_tokens
        if not 1 <= lo <= hi:
            raise ValueError("natural_output_tokens must be [lo, hi] with 1 <= lo <= hi")
        return self

    @property
    def max_accept(self) -> int:
        """Most tokens one request can gain in one step (drafted tokens plus the bonus token)."""
        return self.speculative_num_steps + 1 if self.speculative else 1

    def step_ms(self, n: int) -> float:
        """Duration of one decode step with n running requests (straight on past the profile's cap)."""
        if self.step_points_ms is not None:
            return _interpolate(self.step_points_ms, n)
        a, b, q, cap = self.decode_a_ms, self.decode_b_ms, self.decode_q_ms, self.max_running_requests
        if n <= cap or q >= 0:
            return a + b * n + q * n * n
        return a + b * cap + q * cap * cap + (b + 2 * q * cap) * (n - cap)

    def adaptive_step_ms(self, steps: int, n: int) -> float:
        """An adaptive server's decode step of n requests drafting `steps` steps (0: decode + draft extend)."""
        curves = self.adaptive_step_points_ms
        if not curves or steps not in curves:
            raise ProfileError(f"profile {self.name} has no step curve for {steps} draft steps")
        return _interpolate(curves[steps], n)

    def prefill_ms(self, new_tokens: int, attention_pairs: int = 0) -> float:
        if not new_tokens:
            return 0.0
        return (self.prefill_base_ms + self.prefill_ms_per_token * new_tokens
                + self.prefill_attention_ms_per_mpair * attention_pairs / 1e6)


def tp4_estimate(tp8: Profile, name: str, description: str) -> Profile:
    """The same server on half the GPUs (TP4), estimated from a TP8 profile's fitted line, not measured.

    Decode is taken as memory-bandwidth bound: the per-request and KV terms double (each GPU holds and reads
    twice the data), the fixed term grows 1.6x (twice the weights per GPU, a cheaper all-reduce over 4 ranks),
    prefill costs double, and 40% of the TP8 KV capacity is left after the weights. A baseline server's cap
    halves (its measured cap bounds the batch that fits); an EAGLE server keeps SGLang's 48."""
    return tp8.model_copy(update={
        "name": name, "description": description, "tp_size": 4, "step_points_ms": None,
        "decode_a_ms": round(1.6 * tp8.decode_a_ms, 4), "decode_b_ms": round(2 * tp8.decode_b_ms, 5),
        "decode_q_ms": round(2 * tp8.decode_q_ms, 8), "kv_ms_per_ktoken": round(2 * tp8.kv_ms_per_ktoken, 6),
        "prefill_base_ms": 2 * tp8.prefill_base_ms, "prefill_ms_per_token": round(2 * tp8.prefill_ms_per_token, 6),
        "prefill_attention_ms_per_mpair": round(2 * tp8.prefill_attention_ms_per_mpair, 6),
        "max_total_num_tokens": int(0.4 * tp8.max_total_num_tokens),
        "max_running_requests": tp8.max_running_requests if tp8.speculative else tp8.max_running_requests // 2,
        "fitted_from": f"derived from {tp8.name}",
    })


def _interpolate(points: list[tuple[int, float]], n: float) -> float:
    """Piecewise-linear through the points; the end segments carry on straight outside them."""
    return max(interpolate(points, n, extend=True), 0.01)


def builtin_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def read_json_file(path: Path, what: str, error: type[Exception]):
    """A JSON file's content, or `error` with one line saying which `what` file and why."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read {what} {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{what} {path} is not valid JSON: {exc}") from None


def load_profile_file(path: str | Path) -> Profile:
    path = Path(path)
    data = read_json_file(path, "profile file", ProfileError)
    if not isinstance(data, dict):
        raise ProfileError(f"profile file {path} must hold a JSON object")
    data.setdefault("name", path.stem)
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "profile"
        raise ProfileError(f"invalid profile {path}: {where}: {first['msg']}") from None


def load_profile(name: str) -> Profile:
    """A built-in profile by name (see bench/sim/profiles/*.json), or one the step-cost model derives from a
    preset, `PRESET.SETTING-tpN` (bench.sim.stepcost.profile_by_name)."""
    path = PROFILE_DIR / f"{name}.json"
    if not path.is_file():
        if "." in name and "/" not in name:
            from bench.sim.stepcost import profile_by_name

            return profile_by_name(name)
        raise ProfileError(f"unknown profile {name!r}; choose from {', '.join(builtin_names())} "
                           "or a derived PRESET.SETTING-tpN (docs/SIMULATOR.md)")
    return load_profile_file(path)
