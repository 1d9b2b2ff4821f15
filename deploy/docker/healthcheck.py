"""Container health check: exit 0 when GET <url> answers 200 within 4 s, else 1.

Usage: python3 healthcheck.py [URL]   (default: $HELIX_HEALTH_URL). Standard library only.
"""

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("HELIX_HEALTH_URL", "http://127.0.0.1:8000/health")
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
