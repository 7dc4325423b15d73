"""The project's error hierarchy: one root, a few kinds a caller can act on.

Library code raises these; only the CLI turns them into messages and exit codes
(see `mrtr_keys.cli.main`), and only codecs raise the MCP SDK's
`InvalidRequestState`. No message ever contains key material, a token or a secret.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

from mrtr_keys.urls import scrub


class MrtrKeysError(Exception):
    """Root of every error this package raises on purpose (CLI exit code 1). Its message passes
    through `mrtr_keys.urls.scrub`, so a store or client library's error text wrapped in it never
    carries a credential of a URL the process was given."""

    exit_code = 1

    def __init__(self, *args: object) -> None:
        super().__init__(*(scrub(a) if isinstance(a, str) else a for a in args))


class ConfigError(MrtrKeysError):
    """Bad configuration or arguments: a path, URL, option or audience that cannot work (exit 2)."""

    exit_code = 2


class AudienceError(ConfigError):
    """The audience asked for is outside the key ring's audience scope (exit 2)."""


class KeyRingError(MrtrKeysError):
    """A key ring document is invalid: duplicate kid, no or two primaries, bad material, bad JSON."""


class UnknownKid(MrtrKeysError):
    """A command named a kid the key ring does not hold (``keys revoke``; exit 1)."""


class KeystoreError(MrtrKeysError):
    """A keystore could not be read or written (missing file, unsafe mode, I/O error)."""


class KeyRingNotFound(KeystoreError):
    """No key ring exists at the keystore's location (run `mrtr-keys init`)."""

    exit_code = 2


class KeyRingExists(KeystoreError):
    """`init` refused: a key ring already exists there and is never overwritten."""


class KeystoreBusy(KeystoreError):
    """Another run held the key ring's lock for longer than the lock timeout (exit 75: retry later)."""

    exit_code = 75


class KeystoreUnavailable(KeystoreError):
    """A remote keystore (Vault, Secrets Manager) could not be reached or answered 5xx (exit 75: retry later).

    Nothing was written; a running codec keeps serving the ring it loaded last.
    """

    exit_code = 75


class ConflictError(KeystoreError):
    """Compare-and-swap lost: the key ring's generation changed since it was read."""


class RotationError(MrtrKeysError):
    """A rotation step is refused because it skips ahead or goes back; the message names what to run."""


class NotYet(RotationError):
    """A rotation step is not allowed yet (exit 75, EX_TEMPFAIL); `wait_seconds` says for how long (the
    longest known wait), `waits` lists every gate still closed (``{"for", "seconds", "detail"}``)."""

    exit_code = 75

    def __init__(
        self, message: str, *, wait_seconds: float | None = None, waits: list[dict[str, object]] | None = None
    ) -> None:
        super().__init__(message)
        self.wait_seconds = wait_seconds
        self.waits = waits


class BackendUnavailable(MrtrKeysError):
    """A remote backend (KMS, Vault, the sidecar) could not be reached or answered 5xx.

    Distinct from `InvalidRequestState`: the token may be fine, the service is not.
    """


class WrappingKeyRevoked(MrtrKeysError):
    """The wrapping key of a data-key ring (a KMS key, a Vault transit key) answered that it is disabled,
    deleted or denied to this instance: the codec fails closed until it answers again (`mrtr_keys.codecs.kek`).
    Not a `BackendUnavailable`: an outage keeps the instance serving, this does not."""


class UnwrapError(MrtrKeysError):
    """A wrapped data key could not be unwrapped (wrong context, wrong key, corrupted, denied)."""


class AuditError(MrtrKeysError):
    """The audit store cannot be opened, read or written (bad URL, I/O or database error)."""


class AuditUnavailable(AuditError):
    """The audit store or the archive cannot be reached: a connection refused, cut or timed out, a
    held lock, an I/O error (exit 75, EX_TEMPFAIL: retry later). A broken chain is exit 1 instead,
    so cron can tell an outage from tampering (docs/audit.md)."""

    exit_code = 75


class AuditBusy(AuditError):
    """Another prune or archive of this checkpoint file is running (exit 75: retry later)."""

    exit_code = 75


class ReplayStoreUnavailable(BackendUnavailable):
    """The single-use (replay) store could not be reached or answered with an error (docs/single-use.md)."""


def refuse_nul(text: str, what: str) -> None:
    """Raise `ConfigError` (``WHAT cannot contain a NUL byte``) if `text`, percent-decoded, holds one: the
    operating system cannot name a file with a NUL byte in it (``%00`` once percent-decoded), and Python
    would raise a bare `ValueError`. Every URL or path that names a file goes through it first."""
    if "\x00" in text or "\x00" in unquote(text):
        raise ConfigError(f"{what} cannot contain a NUL byte")


def keywords_of(*functions: Callable[..., Any]) -> frozenset[str]:
    """The names of the keyword arguments `functions` take (``self`` and ``**kwargs`` left out)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(
        name
        for fn in functions
        for name, param in inspect.signature(fn).parameters.items()
        if param.kind in kinds and name != "self"
    )


def check_keywords(given: Iterable[str], valid: Iterable[str], where: str) -> None:
    """Refuse a keyword argument that `where` (an entry point's name) does not take: a misspelled
    security setting (``reload_evry=3``) must not pass unseen (issue 39).

    Raises:
        ConfigError: ``WHERE got an unknown keyword NAME= (the closest it takes is OTHER=)``, for the
            first unknown name in sorted order; the closest is by `difflib` similarity.
    """
    known = sorted(set(valid))
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return
    name = unknown[0]
    closest = difflib.get_close_matches(name, known, n=1, cutoff=0.0)
    hint = f" (the closest it takes is {closest[0]}=)" if closest else ""
    raise ConfigError(f"{where} got an unknown keyword {name}={hint}")


def bare(exc: BaseException) -> BaseException:
    """`exc` without its traceback (nor those of the exceptions it chains), for a caller that keeps or chains it.

    A failed psycopg connect leaves its socket to the attempt's frames (psycopg keeps the error in a local of
    the frame its traceback holds: a cycle), so until a garbage collection runs, every attempt that timed out
    would still hold a socket, and once the network heals the server a backend for each (the replay store saw
    100-250 PostgreSQL backends at once after a silent spell; the audit writer 8 sockets after two)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc
