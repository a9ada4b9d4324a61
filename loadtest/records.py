"""Per-attempt records, kept compact (a multi-hour soak makes hundreds of thousands)."""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field

# Outcomes that are not HTTP statuses are stored as negative codes.
TIMEOUT = -1
REFUSED = -2
DISCONNECTED = -3
CLIENT_ERROR = -4
CANCELLED = -5
BAD_RESPONSE = -6

CODE_NAMES = {
    TIMEOUT: "timeout",
    REFUSED: "connection_refused",
    DISCONNECTED: "disconnected",
    CLIENT_ERROR: "client_error",
    CANCELLED: "cancelled_at_stop",
    BAD_RESPONSE: "bad_response",
}


def code_name(code: int) -> str:
    """``"200"``, ``"503"``, ``"timeout"``, ``"connection_refused"``..."""
    return CODE_NAMES.get(code, str(code))


def is_ok(code: int) -> bool:
    return 200 <= code < 300


@dataclass
class Recorder:
    """Columns of one row per HTTP attempt (a 429 then its retry are two attempts).

    ``t`` is the send time in seconds since the run started; ``warm`` marks warm-up rows.
    """

    t: array = field(default_factory=lambda: array("d"))
    latency: array = field(default_factory=lambda: array("d"))
    code: array = field(default_factory=lambda: array("i"))
    tokens: array = field(default_factory=lambda: array("q"))
    usage_tokens: array = field(default_factory=lambda: array("q"))
    inputs: array = field(default_factory=lambda: array("i"))
    warm: array = field(default_factory=lambda: array("b"))
    recent: deque[tuple[float, float, int]] = field(default_factory=lambda: deque(maxlen=4096))

    def add(self, t: float, latency: float, code: int, tokens: int, usage_tokens: int,
            inputs: int, warm: bool) -> None:
        self.t.append(t)
        self.latency.append(latency)
        self.code.append(code)
        self.tokens.append(tokens)
        self.usage_tokens.append(usage_tokens)
        self.inputs.append(inputs)
        self.warm.append(1 if warm else 0)
        self.recent.append((t + latency, latency, code))

    def __len__(self) -> int:
        return len(self.t)
