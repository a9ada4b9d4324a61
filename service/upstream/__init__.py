"""The gateway's side of the engines: the HTTP client, the pool that routes calls and checks
engine health, which call a model's rows come from, and measured throughput. What runs inside
an engine process lives in ``embedserve.engines``."""
