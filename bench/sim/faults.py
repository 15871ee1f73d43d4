"""Fault switches of the simulator (start-up flags and the /_sim/faults admin endpoint) and their validation."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# every kind counted in sim_faults_injected_total{kind}
FAULT_KINDS = ("error", "hang", "stall", "drop", "health_delay", "health_status", "refuse")


class Faults(BaseModel):
    """Which faults are on. Times are wall-clock seconds (not divided by --speedup): they test the router."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    error_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    error_status: Literal[500, 503] = 500
    hang: bool = False
    stall_after_chunks: int | None = Field(default=None, ge=0)
    drop_after_chunks: int | None = Field(default=None, ge=0)
    health_delay: float = Field(default=0.0, ge=0.0)
    health_status: int | None = Field(default=None, ge=200, le=599)
    refuse_for: float = Field(default=0.0, ge=0.0)

    def merged(self, update: dict) -> Faults:
        """A copy with the fields in update replaced (validated; unknown fields rejected)."""
        return Faults.model_validate({**self.model_dump(), **update})
