"""Does a server answer? One quick check for the services a command depends on."""
from __future__ import annotations

import urllib.error
import urllib.request


def error(url: str, timeout: float) -> str | None:
    """None when ``url`` gives any HTTP answer within ``timeout`` seconds, else why not (one line)."""
    try:
        urllib.request.urlopen(url, timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as e:
        return str(getattr(e, "reason", e))
    return None
