"""Admission control bounded by tokens in flight: past the bound, answer 429 now rather
than queue without limit (memory and tail latency stay bounded under overload)."""

from __future__ import annotations


class TokenAdmission:
    def __init__(self, max_tokens_in_flight: int) -> None:
        self.limit = max_tokens_in_flight
        self.in_flight = 0

    def try_acquire(self, tokens: int) -> bool:
        """A request larger than the whole bound is still admitted when nothing else runs,
        so every valid request can eventually be served."""
        if self.in_flight and self.in_flight + tokens > self.limit:
            return False
        self.in_flight += tokens
        return True

    def release(self, tokens: int) -> None:
        self.in_flight -= tokens
