"""Settings of the sealing sidecar: listener, limits, reload interval, where the ring and clients live.

A config file is TOML with one ``[sidecar]`` table; command-line options win
over the file, the file wins over the defaults::

    [sidecar]
    keystore = "/var/lib/mrtr/keyring.json"   # else --keystore / MRTR_KEYS_KEYSTORE
    clients = "/var/lib/mrtr/clients.json"    # else MRTR_KEYS_CLIENTS, else the state directory
    host = "127.0.0.1"
    port = 8750
    uds = "/run/mrtr/sidecar.sock"            # listen on a Unix socket (mode 0600) instead of TCP
    workers = 1
    reload_interval = 2.0                     # seconds between keystore / registry checks (0: off)
    instance = "sidecar-1"                    # presence name (else MRTR_KEYS_INSTANCE, else host:pid)
    heartbeat_interval = 10.0                 # seconds between presence heartbeats
    lease = 30.0                              # self-fencing lease (default 3 heartbeats; 0: off)
    max_fenced_out = 600.0                    # refuse after serving fenced out this long (default: off)
    kek_check_every = 300.0                   # seconds between checks of a KMS / Vault wrapping key (0: off)
    max_body_bytes = 4259840                  # default: the 4 MiB token cap + 64 KiB of JSON around it
    max_batch_items = 256
    http = "corked"                           # or "httptools": uvicorn's own writes (else --http / MRTR_KEYS_HTTP)
    max_header_bytes = 32768                  # a longer request head gets 431
    header_timeout = 5.0                      # seconds for a request head to arrive (else closed, 408)
    body_timeout = 5.0                        # seconds for a request body to arrive after its head (else closed)
    keep_alive_timeout = 8.0                  # seconds an idle kept-alive connection stays open
    max_connections = 4096                    # connections beyond it get 503 too_many_connections
    max_connections_per_peer = 256            # from one client address (else --max-connections-per-peer)
    write_timeout = 10.0                      # seconds a response write may make no progress (else closed)
    audit = "sqlite:///var/lib/mrtr/audit.db"  # else MRTR_KEYS_AUDIT, else audit.db beside the ring; "off"
    strict_audit = false                      # true: a failing audit sink fails the request (503)
    audit_retention = "30d"                   # prune the audit log by itself, keeping this much (default: off)
    audit_retention_interval = 3600.0         # seconds between retention runs
    audit_anchor = "s3://audit-anchors/fleet-a"  # the chains' heads, MACed, every interval (a file, a directory,
                                              # s3:// with Object Lock; else --audit-anchor / MRTR_KEYS_AUDIT_ANCHOR)
    audit_anchor_every = 300.0                # seconds between anchors
    log_format = "json"                       # else --log-format / MRTR_KEYS_LOG_FORMAT, else text
    audit_factory = "package.module:factory"  # optional: called with the ServiceConfig, returns an audit sink
    replay_store = "redis://127.0.0.1:6379/0" # single-use unseals (docs/single-use.md); or postgresql://...
    single_use_clients = ["billing"]          # only these clients' unseals (default: every unseal)
    single_use_audiences = ["payments"]       # ... or these audiences'
    on_replay_store_error = "deny"            # "allow": serve unseals unrecorded while the store fails
    expect_codec = "kms"                      # refuse rings of another codec (else --expect-codec /
                                              # MRTR_KEYS_EXPECT_CODEC; MRTR_KEYS_KMS_KEY_ID implies kms)
    allow_core_dumps = false                  # true: stay dumpable (debugging; else --allow-core-dumps)
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from mrtr_keys.errors import ConfigError
from mrtr_keys.ring.model import CODEC_TYPES
from mrtr_keys.token import MAX_TOKEN_CHARS
from mrtr_keys.urls import redact

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8750
DEFAULT_RELOAD_INTERVAL = 2.0
DEFAULT_HEARTBEAT_INTERVAL = 10.0
MAX_RELOAD_INTERVAL = 86400.0
DEFAULT_MAX_BODY_BYTES = MAX_TOKEN_CHARS + 64 * 1024
"""Largest request body accepted (bytes); larger ones get 413 before any parsing. The default holds one
token (or one payload's base64url) at the token cap, `mrtr_keys.token.MAX_TOKEN_CHARS`, plus the JSON
around it, so anything the MCP SDK's HTTP transport can deliver can be sealed or unsealed."""
MAX_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_BATCH_ITEMS = 256
"""Most items in one ``/v1/seal/batch`` or ``/v1/unseal/batch`` request."""
MAX_MAX_BATCH_ITEMS = 10000
MAX_WORKERS = 64
REPLAY_SCHEMES = frozenset({"redis", "rediss", "postgresql", "postgres"})
"""URL schemes of the replay stores (`mrtr_keys.replay.store.open_store`)."""
HTTP_CHOICES = ("corked", "httptools")
"""``corked``: uvicorn's httptools protocol writing each response in one ``writev`` (default);
``httptools``: uvicorn's own writes. Both enforce the connection limits (`mrtr_keys.service.protocol`)."""
DEFAULT_MAX_HEADER_BYTES = 32 * 1024
DEFAULT_HEADER_TIMEOUT = 5.0
DEFAULT_BODY_TIMEOUT = 5.0
DEFAULT_KEEP_ALIVE_TIMEOUT = 8.0
"""Longer than httpx's 5 s pool expiry (`SidecarCodec`), so a client never reuses a connection we just closed."""
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_CONNECTIONS_PER_PEER = 256
"""Connections one client address may hold open at once (so one peer cannot take all `DEFAULT_MAX_CONNECTIONS`)."""
DEFAULT_WRITE_TIMEOUT = 10.0
"""Seconds a response may sit in the send buffer without the client reading (16 KiB) before the connection is cut."""
MAX_TIMEOUT = 3600.0


@dataclass(frozen=True)
class ServiceConfig:
    """Validated sidecar settings (units: seconds and bytes)."""

    keystore: str | None = None
    clients: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    uds: str | None = None
    workers: int = 1
    reload_interval: float = DEFAULT_RELOAD_INTERVAL
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_batch_items: int = DEFAULT_MAX_BATCH_ITEMS
    audit: str | None = None
    state_dir: str | None = None
    log_format: str | None = None
    strict_audit: bool = False
    audit_factory: str | None = None
    replay_store: str | None = None
    single_use_clients: tuple[str, ...] = ()
    single_use_audiences: tuple[str, ...] = ()
    on_replay_store_error: str = "deny"
    http: str = "corked"
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER
    write_timeout: float = DEFAULT_WRITE_TIMEOUT
    instance: str | None = None
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    audit_retention: str | None = None
    """Keep this much of the audit log (a duration, ``30d``) and prune the rest by itself
    (`mrtr_keys.audit.retention.loop`); None: off."""
    audit_retention_interval: float = 3600.0
    audit_anchor: str | None = None
    """Where the heads of this sidecar's chains are anchored (a file, a directory, ``s3://BUCKET/PREFIX``;
    `mrtr_keys.audit.verifying.anchor`); None: off."""
    audit_anchor_every: float = 300.0
    lease: float | None = None
    """Seconds a successful keystore check lets the sidecar serve without another (`mrtr_keys.codecs.fence`);
    None: 3 heartbeat intervals, or 0 (off) when `reload_interval` is 0."""
    max_fenced_out: float | None = None
    """Seconds the sidecar may serve fenced out (keystore unreachable past the lease) before it answers 503
    (`mrtr_keys.codecs.fence.Fence.max_fenced_out`); None or 0: no cap."""
    kek_check_every: float | None = None
    """Seconds between checks of a data-key ring's wrapping key (`mrtr_keys.codecs.kek`); None:
    ``MRTR_KEYS_KEK_CHECK_EVERY``, else 300; 0: off."""
    allow_core_dumps: bool = False
    """Leave the sidecar, its workers and its children dumpable, with core dumps as the system sets them
    (`mrtr_keys.hardening`); False: as ``MRTR_KEYS_ALLOW_CORE_DUMPS`` says, by default not dumpable and no
    core file."""
    expect_codec: str | None = None
    """The only codec type whose rings are loaded (`mrtr_keys.codecs.pin`); None: ``MRTR_KEYS_EXPECT_CODEC``,
    else any (``MRTR_KEYS_KMS_KEY_ID`` pins ``kms`` and the KMS key)."""

    def __post_init__(self) -> None:
        for name in _TEXT_SETTINGS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or "\x00" in value):
                raise ConfigError(f"{name} must be a string without a NUL byte{_TEXT_SETTINGS[name]}")
        for name in ("single_use_clients", "single_use_audiences"):
            names = getattr(self, name)
            if isinstance(names, str) or not isinstance(names, list | tuple):
                raise ConfigError(f"{name} must be a list of names")
            if not all(isinstance(n, str) and n for n in names):
                raise ConfigError(f"{name} must hold non-empty names")
            object.__setattr__(self, name, tuple(names))
        if (self.single_use_clients or self.single_use_audiences) and not self.replay_store:
            raise ConfigError("single_use_clients / single_use_audiences need replay_store (docs/single-use.md)")
        if self.replay_store is not None and (not isinstance(self.replay_store, str) or not self.replay_store):
            raise ConfigError("replay_store must be a store URL: redis://HOST:PORT/DB or postgresql://...")
        if self.replay_store is not None and self.replay_store.partition(":")[0].lower() not in REPLAY_SCHEMES:
            raise ConfigError(
                f"unsupported replay store URL {redact(self.replay_store)!r} (use redis://HOST:PORT/DB or "
                "postgresql://USER@HOST/DB)"
            )
        if self.on_replay_store_error not in ("deny", "allow"):
            raise ConfigError('on_replay_store_error must be "deny" or "allow"')
        _int_in("port", self.port, 1, 65535)
        _int_in("workers", self.workers, 1, MAX_WORKERS)
        _int_in("max_body_bytes", self.max_body_bytes, 1024, MAX_MAX_BODY_BYTES)
        _int_in("max_batch_items", self.max_batch_items, 1, MAX_MAX_BATCH_ITEMS)
        r = self.reload_interval
        number = isinstance(r, int | float) and not isinstance(r, bool)
        if not (number and math.isfinite(r) and 0 <= r <= MAX_RELOAD_INTERVAL):
            raise ConfigError(f"reload_interval must be a number of seconds from 0 (off) to {MAX_RELOAD_INTERVAL:g}")
        h = self.heartbeat_interval
        if not (isinstance(h, int | float) and not isinstance(h, bool) and 0.05 <= h <= 3600):
            raise ConfigError("heartbeat_interval must be a number of seconds from 0.05 to 3600")
        if self.lease is not None or self.max_fenced_out is not None:
            from mrtr_keys.codecs.fence import check_lease

            if self.lease is not None:
                check_lease(self.lease)
            if self.max_fenced_out is not None:
                check_lease(self.max_fenced_out, "max_fenced_out")
        if self.kek_check_every is not None:
            from mrtr_keys.codecs.kek import check_every

            check_every(self.kek_check_every)
        if self.instance is not None:
            from mrtr_keys.fleet.presence import instance_name

            instance_name(self.instance)
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError("host must be a non-empty string")
        if self.audit is not None and not isinstance(self.audit, str):
            raise ConfigError("audit must be a store URL (sqlite:///PATH, postgresql://..., jsonl:///PATH) or off")
        if self.expect_codec is not None and self.expect_codec not in CODEC_TYPES:
            raise ConfigError(f"expect_codec must be one of {', '.join(sorted(CODEC_TYPES))}")
        if self.log_format not in (None, "text", "json"):
            raise ConfigError("log_format must be text or json")
        if self.audit_retention is not None:
            from mrtr_keys.audit.retention.loop import check_keep

            object.__setattr__(self, "audit_retention", check_keep(self.audit_retention))
        i = self.audit_retention_interval
        if not (isinstance(i, int | float) and not isinstance(i, bool) and 0.05 <= i <= 7 * 86400):
            raise ConfigError("audit_retention_interval must be a number of seconds from 0.05 to 604800")
        from mrtr_keys.audit.verifying import anchor

        object.__setattr__(self, "audit_anchor_every", anchor.check_every(self.audit_anchor_every))
        if self.audit_anchor is not None:
            from mrtr_keys.audit.verifying.ledger import open_ledger

            if not isinstance(self.audit_anchor, str):
                raise ConfigError("audit_anchor must be a file, a directory or s3://BUCKET/PREFIX")
            open_ledger(self.audit_anchor)
        if not isinstance(self.strict_audit, bool):
            raise ConfigError("strict_audit must be true or false")
        if not isinstance(self.allow_core_dumps, bool):
            raise ConfigError("allow_core_dumps must be true or false")
        if self.http not in HTTP_CHOICES:
            raise ConfigError(f"http must be one of {', '.join(HTTP_CHOICES)}")
        _int_in("max_header_bytes", self.max_header_bytes, 1024, 1024 * 1024)
        _int_in("max_connections", self.max_connections, 1, 1_000_000)
        _int_in("max_connections_per_peer", self.max_connections_per_peer, 1, 1_000_000)
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "write_timeout"):
            _seconds(name, getattr(self, name))

    def __repr__(self) -> str:
        """Every setting, with the password of each store URL as ``***`` (`redact`): the dataclass's own repr
        showed ``replay_store`` and ``audit`` whole, and the config reaches code that is not ours (the
        ``audit_factory`` is called with it)."""
        shown = (f"{f.name}={_shown(f.name, getattr(self, f.name))!r}" for f in fields(self))
        return f"ServiceConfig({', '.join(shown)})"

    def with_overrides(self, **changes: Any) -> ServiceConfig:
        """A copy with every non-None value of `changes` applied (validated)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_json(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ServiceConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(f"unknown sidecar setting(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        try:
            return cls(**doc)
        except TypeError as exc:
            raise ConfigError(f"bad sidecar settings: {exc}") from None


_TEXT_SETTINGS = {
    "keystore": " (a path or a keystore URL)",
    "clients": " (the client registry's path)",
    "uds": " (the Unix socket's path)",
    "state_dir": " (a directory)",
    "audit_factory": " (package.module:factory)",
    "instance": "",
}
"""Settings that are text when set (empty: unset, as on the command line): a config file's ``uds = []`` was read as
unset (TCP instead), ``clients = 1`` or a NUL byte in a path was an internal error, ``keystore = 1`` named a file
``1``."""


_URL_SETTINGS = frozenset({"audit", "replay_store", "audit_anchor", "keystore"})
"""Settings that may be a URL with a password in it."""


def _shown(name: str, value: object) -> object:
    return redact(value) if name in _URL_SETTINGS and isinstance(value, str) else value


def _seconds(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT)
    ):
        raise ConfigError(f"{name} must be a number of seconds > 0 and <= {MAX_TIMEOUT:g}")


def _int_in(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer from {low} to {high}")


def load_config(path: str | Path | None) -> ServiceConfig:
    """Read a TOML config file (see the module docstring); None gives the defaults.

    Raises:
        ConfigError: unreadable file, bad TOML, an unknown setting or a value out of range.
    """
    if path is None:
        return ServiceConfig()
    data = _read_config(path)
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    table = doc.get("sidecar", {})
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path}: [sidecar] must be a table")
    return ServiceConfig.from_json(table)


MAX_CONFIG_BYTES = 1024 * 1024
"""A config file larger than this is refused (a few dozen settings take a few hundred bytes)."""


def _read_config(path: str | Path) -> bytes:
    """The bytes of the config file: a regular file of at most `MAX_CONFIG_BYTES`, opened without blocking, so a
    FIFO or ``/dev/zero`` named by mistake is one line (exit 2), not a hang or a read until memory runs out."""
    from mrtr_keys.files import read_small_file

    data = read_small_file(path, "config file", MAX_CONFIG_BYTES)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"cannot read config file {path}: larger than {MAX_CONFIG_BYTES:,} bytes")
    return data
