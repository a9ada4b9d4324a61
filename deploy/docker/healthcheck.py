"""Container health check: exit 0 when the server answers 2xx within the timeout, else 1.

Used by the images' HEALTHCHECK (no curl in slim images). Stdlib only, so it runs in every
image, the SGLang one included:

    python3 healthcheck.py gateway        # GET /health/live on EMBEDSERVE_GATEWAY__PORT (8000)
    python3 healthcheck.py engine [TIMEOUT]  # GET /health on EMBEDSERVE_ENGINE__PORT (30000)
    python3 healthcheck.py http://127.0.0.1:8000/health/live

The port follows the same variable the server reads, so a container configured for another
port is still checked where it listens.
"""

import os
import sys
import urllib.error
import urllib.request

ROLES = {  # role -> (port variable, default port, path)
    "gateway": ("EMBEDSERVE_GATEWAY__PORT", "8000", "/health/live"),
    "engine": ("EMBEDSERVE_ENGINE__PORT", "30000", "/health"),
}


def target(what: str, env: "dict[str, str]") -> str:
    if what not in ROLES:
        return what
    variable, default, path = ROLES[what]
    return f"http://127.0.0.1:{env.get(variable) or default}{path}"


def main(argv: "list[str]") -> int:
    url = target(argv[1] if len(argv) > 1 else "gateway", dict(os.environ))
    timeout = float(argv[2]) if len(argv) > 2 else 3.0
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 0 if 200 <= r.status < 300 else 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
