"""Keep secrets out of text a person or a log will read.

A process remembers each secret it handles (the admin token, a join token, a device's bearer
token, a task secret) with `remember`; `redact` replaces every remembered secret, anything
after `Bearer `, and the password of a URL (`scheme://user:password@host`) with `***`.
Whatever prints an error or a log line passes it through `redact` (seedfed.cli_errors does for
every command), so a secret that slipped into an exception's text is still not shown.
"""

from __future__ import annotations

import re
import threading

MASK = "***"
#: Secrets shorter than this are not remembered: masking every "ab" would garble text, and no
#: token seedfed issues is that short.
MIN_SECRET = 6

_lock = threading.Lock()
_secrets: set[str] = set()

_BEARER = re.compile(r"(?i)(bearer\s+)[^\s'\",;]+")
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@]*:)[^@\s/]+@", re.IGNORECASE)
_KEYS = r"(?:admin_token|join_token|token|secret|password)"
#: `key=value` or a quoted key (`'token': 'value'`, a dict or JSON dump) of a secret field.
_TOKEN_FIELD = re.compile(rf"(?i)((?:['\"]{_KEYS}['\"]\s*:\s*|\b{_KEYS}=)['\"]?)[^'\",\s}}&]+")


def remember(secret: str | None) -> None:
    """Mask `secret` in everything `redact` sees from now on (None and short strings: no-op)."""
    if secret and len(secret) >= MIN_SECRET:
        with _lock:
            _secrets.add(secret)


def redact(text: str) -> str:
    """`text` with every remembered secret, bearer credential, URL password and `token=...`
    field value masked."""
    with _lock:
        known = sorted(_secrets, key=len, reverse=True)  # a longer secret may contain a shorter
    for secret in known:
        if secret in text:
            text = text.replace(secret, MASK)
    text = _BEARER.sub(rf"\g<1>{MASK}", text)
    text = _URL_PASSWORD.sub(rf"\g<1>{MASK}@", text)
    return _TOKEN_FIELD.sub(rf"\g<1>{MASK}", text)


def redact_url(url: str) -> str:
    """A URL fit for a message: its password and query string (where a token could ride)
    removed."""
    url = _URL_PASSWORD.sub(rf"\g<1>{MASK}@", str(url))
    return url.split("?", 1)[0]
