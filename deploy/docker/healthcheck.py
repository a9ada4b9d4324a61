"""Container health check: exit 0 when GET URL answers 2xx within the timeout, else 1.

Used by the images' HEALTHCHECK (no curl in slim images). Stdlib only, so it runs in
every image, the SGLang one included: ``python3 healthcheck.py http://127.0.0.1:8000/health/live``.
"""

import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    url = argv[1] if len(argv) > 1 else "http://127.0.0.1:8000/health/live"
    timeout = float(argv[2]) if len(argv) > 2 else 3.0
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 0 if 200 <= r.status < 300 else 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
