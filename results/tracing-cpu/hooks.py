"""The tracing hooks' cost with tracing off, in process: what a request pays for them."""

import json
import sys
import timeit
from types import SimpleNamespace

from embedserve.core import tracing
from embedserve.core.tracing import request_trace

one = [SimpleNamespace(trace=None, truncated=False)]
call = [SimpleNamespace(trace=None, truncated=False) for _ in range(256)]


def per_call_ns(stmt, number=200_000):
    return round(min(timeit.repeat(stmt, number=number, repeat=7)) / number * 1e9, 1)


rows = {
    "an empty call (what timing a call costs)": per_call_ns(lambda: None),
    "tokenize hook (pipeline, scoring)": per_call_ns(lambda: tracing.tokenized("m", 0.0, 0.0, one)),
    "enqueue: read the request's trace (coalescer)": per_call_ns(request_trace.get),
    "engine call of 1 input: traced inputs (coalescer)": per_call_ns(
        lambda: [it.trace for it in one if it.trace is not None]
    ),
    "engine call of 256 inputs: traced inputs (coalescer)": per_call_ns(
        lambda: [it.trace for it in call if it.trace is not None], 20_000
    ),
}
print(json.dumps({"python": sys.version.split()[0], "ns_per_call": rows}, indent=1))
