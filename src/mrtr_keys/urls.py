"""Store and service URLs as users write them: passwords redacted for messages, NUL bytes refused.

Every URL that may carry a credential (``postgresql://USER:PASSWORD@...``, ``redis://:PASSWORD@...``,
``http://USER:PASSWORD@...``) goes through `redact` before it reaches a log line, an error message or a
`repr()`; every URL or path that names a file goes through `refuse_nul` first, because the operating
system cannot name a file with a NUL byte in it (``%00`` once percent-decoded) and Python would raise a
bare `ValueError`.
"""

from __future__ import annotations

from urllib.parse import unquote, urlparse, urlunparse

from mrtr_keys.errors import ConfigError


def redact(url: str) -> str:
    """`url` with any password (the part after ``:`` in ``USER:PASSWORD@``) replaced by ``***``."""
    try:
        parsed = urlparse(url)
        password = parsed.password
    except ValueError:  # an unparsable netloc (a bad port, an unclosed "["): show no userinfo at all
        head, sep, rest = url.partition("://")
        return head + sep + rest.rpartition("@")[2] if sep else url
    if password is None:
        return url
    netloc = parsed.netloc.replace(":" + password + "@", ":***@", 1)
    return urlunparse(parsed._replace(netloc=netloc))


def refuse_nul(text: str, what: str) -> None:
    """Raise `ConfigError` (``WHAT cannot contain a NUL byte``) if `text`, percent-decoded, holds one."""
    if "\x00" in text or "\x00" in unquote(text):
        raise ConfigError(f"{what} cannot contain a NUL byte")
