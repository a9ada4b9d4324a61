"""Container health check: exit 0 when the server answers 2xx within the timeout, else 1.

Used by the images' HEALTHCHECK (no curl in slim images). Stdlib only, so it runs in every
image, the SGLang one included:

    python3 healthcheck.py gateway        # GET /health/live on EMBEDSERVE_GATEWAY__PORT (8000)
    python3 healthcheck.py engine [TIMEOUT]  # GET /health on EMBEDSERVE_ENGINE__PORT (30000)
    python3 healthcheck.py engine-verdict [TIMEOUT]  # the gateway's verdict on the engine
    python3 healthcheck.py http://127.0.0.1:8000/health/live

The port follows the same variable the server reads, so a container configured for another
port is still checked where it listens.

``engine-verdict`` is the Kubernetes engine container's liveness: the gateway's
``/health/live`` judges the engine (dead, hung, memory out within the critical horizon), so
its failure answer restarts the engine. But a gateway that does not answer at all says
nothing about the engine: that passes (with a note), and the gateway container's own
liveness restarts the gateway instead of a healthy engine.
"""

import os
import sys
import urllib.error
import urllib.request

ROLES = {  # role -> (port variable, default port, path)
    "gateway": ("EMBEDSERVE_GATEWAY__PORT", "8000", "/health/live"),
    "engine": ("EMBEDSERVE_ENGINE__PORT", "30000", "/health"),
    "engine-verdict": ("EMBEDSERVE_GATEWAY__PORT", "8000", "/health/live"),
}


def target(what: str, env: "dict[str, str]") -> str:
    if what not in ROLES:
        return what
    variable, default, path = ROLES[what]
    return f"http://127.0.0.1:{env.get(variable) or default}{path}"


def main(argv: "list[str]") -> int:
    role = argv[1] if len(argv) > 1 else "gateway"
    url = target(role, dict(os.environ))
    timeout = float(argv[2]) if len(argv) > 2 else 3.0
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 0 if 200 <= r.status < 300 else 1
    except urllib.error.HTTPError as exc:  # an answer: the server's verdict
        print(f"unhealthy: {url}: {exc.code} {exc.read()[:300]!r}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        if role == "engine-verdict":  # no verdict: the gateway's own probe deals with the gateway
            print(f"no verdict (passing): {url}: {exc}", file=sys.stderr)
            return 0
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
