"""Store and service URLs as users write them: passwords redacted for messages.

Every URL that may carry a credential (``postgresql://USER:PASSWORD@...``, ``redis://:PASSWORD@...``,
``http://USER:PASSWORD@...``) goes through `redact` before it reaches a log line, an error message or a
`repr()`; every URL or path that names a file goes through `mrtr_keys.errors.refuse_nul` first.

A client library's error text can echo a credential in any form (libpq quotes a badly percent-encoded
password; a URL it cannot parse comes back whole). So every URL the process is given is remembered
(`remember`, which `redact` calls): its whole userinfo and its password (and a ``password=`` query
parameter), as written and percent-decoded. `scrub` is the one redaction of error text: it replaces each
remembered secret, and the password of any ``scheme://user:password@`` in the text, by ``***``. Every
`mrtr_keys.errors.MrtrKeysError` message and every log line our handler writes passes through it (issue 22).
"""

from __future__ import annotations

import re
import threading
from urllib.parse import parse_qsl, unquote, urlparse, urlunparse

MIN_SECRET_CHARS = 3
"""Shorter userinfo or passwords are not remembered (replacing one or two characters everywhere would
garble every message; such a password is no protection anyway)."""
_secrets: frozenset[str] = frozenset()
_secrets_lock = threading.Lock()
_PASSWORD_KEYS = ("password", "passwd")
"""Query parameters holding a password, compared percent-decoded and in any case (libpq decodes a
parameter's name too: ``?pass%77ord=`` is its ``password``)."""
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s/@:]*):[^\s/@]*@")


def remember(url: str) -> None:
    """Remember the credentials in `url` (userinfo, password, ``password=``; as written and
    percent-decoded) so that `scrub` removes them from any text. Never raises."""
    global _secrets
    if not isinstance(url, str):
        return
    _, sep, rest = url.partition("://")
    found: list[str] = []
    if sep and "@" in rest:
        userinfo = rest.rpartition("@")[0]
        password = userinfo.partition(":")[2]
        found += [userinfo, password] if password else []
    query = url.partition("?")[2]
    found += [v for k, v in parse_qsl(query, keep_blank_values=True) if k.lower() in _PASSWORD_KEYS]
    found += [v for k, v in _params(query) if unquote(k).lower() in _PASSWORD_KEYS]  # as written: "%46" too
    new = {form for s in found for form in (s, unquote(s)) if len(form) >= MIN_SECRET_CHARS} - _secrets
    if new:
        with _secrets_lock:
            _secrets = _secrets | new


def scrub(text: str) -> str:
    """`text` with every remembered credential and any URL password replaced by ``***``."""
    if "://" in text:
        text = _USERINFO.sub(r"\1:***@", text)
    for secret in sorted(_secrets, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, "***")
    return text


def redact(url: str) -> str:
    """`url` with any password (the part after ``:`` in ``USER:PASSWORD@``, and a ``password=`` query
    parameter) replaced by ``***`` (and its credentials remembered for `scrub`)."""
    remember(url)
    try:
        parsed = urlparse(url)
        password = parsed.password
    except ValueError:  # an unparsable netloc (a bad port, an unclosed "["): show no userinfo at all
        head, sep, rest = url.partition("://")
        if not sep:
            return url
        base, mark, query = rest.rpartition("@")[2].partition("?")
        return head + sep + base + mark + _redact_query(query)
    query = _redact_query(parsed.query)
    in_query = query != parsed.query
    if in_query:  # libpq's ``?password=`` too
        parsed = parsed._replace(query=query)
    if password is None:
        return urlunparse(parsed) if in_query else url
    netloc = parsed.netloc.replace(":" + password + "@", ":***@", 1)
    return urlunparse(parsed._replace(netloc=netloc))


def _params(query: str) -> list[tuple[str, str]]:
    """``(name, value)`` of each ``name=value`` of `query`, as written (not decoded)."""
    return [(k, v) for k, eq, v in (part.partition("=") for part in query.split("&")) if eq]


def _redact_query(query: str) -> str:
    """`query` with the value of each password parameter (`_PASSWORD_KEYS`) replaced by ``***``."""
    if "=" not in query:
        return query
    parts = []
    for part in query.split("&"):
        key, eq, _ = part.partition("=")
        parts.append(key + "=***" if eq and unquote(key).lower() in _PASSWORD_KEYS else part)
    return "&".join(parts)
