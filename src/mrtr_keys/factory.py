"""The library entry point: a ready `RequestStateSecurity` from a keystore location."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterable
from typing import Any, Literal

from mcp.server.mcpserver import RequestStateSecurity

from mrtr_keys.backends import ALL_BACKEND_OPTIONS, Codec, backend_for
from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.codecs.pin import RingPin
from mrtr_keys.errors import ConfigError, check_keywords, keywords_of
from mrtr_keys.keystores import Keystore, as_keystore
from mrtr_keys.replay import defer_observer, with_single_use

ENV_SIDECAR_URL = "MRTR_KEYS_SIDECAR_URL"
"""The sealing sidecar `request_state_security` uses when given neither ``sidecar=`` nor ``keystore=``."""


def open_codec(
    keystore: Keystore | str | os.PathLike[str] | None = None,
    *,
    audience: str,
    observer: CodecObserver | None = None,
    reload_every: float | None = None,
    instance: str | None = None,
    heartbeat_every: float | None = None,
    lease: float | None = None,
    max_fenced_out: float | None = None,
    expect_codec: str | None = None,
    **backend_options: Any,
) -> Codec:
    """The codec the stored ring records (local, KMS, Vault transit), opened for `audience`, that
    keeps itself current.

    A `mrtr_keys.keystores.watch.RingWatcher` (daemon thread, the codec's ``watcher`` attribute)
    checks the keystore every `reload_every` seconds (default 2, with jitter) and reloads when the
    ring changed; 0 turns that off (logged). The watcher's ``last_check`` is the POSIX time of its last
    completed check and ``stuck_since()`` says when none has completed for 3 intervals (a keystore call
    that never returns; the heartbeat then carries ``watcher stuck since ...``). With an audit
    `observer`, the instance also writes presence heartbeats (`mrtr_keys.fleet.presence`, the codec's
    ``presence`` attribute) every `heartbeat_every` seconds (default 10) under the name `instance`
    (default ``MRTR_KEYS_INSTANCE``, else ``host:pid``).

    Every seal, unseal and rejection is counted per kid (`mrtr_keys.codecs.usage`): with an audit store the
    instance also reserves and reports them there, fleet-wide (`mrtr_keys.fleet.usage`); with a meter provider
    set they are OpenTelemetry counters too (`mrtr_keys.codecs.usage_otel`).

    The codec also fences itself (`mrtr_keys.codecs.fence`, its ``fence`` attribute): once `lease`
    seconds have passed since its last successful keystore check (a pause, an outage), a seal or unseal
    first checks the keystore; and an unseal that meets an unknown kid looks at the keystore once
    (at most once a second) before refusing. `lease` defaults to the gates' staleness window, 3 x
    `heartbeat_every` (30 s), or 0 (off) when `reload_every` is 0; 0 turns it off. `max_fenced_out`
    (seconds, default None: off) caps how long it serves fenced out: past it, seals raise and unseals are
    refused (reason ``fenced out too long``) until a keystore check succeeds again.

    A KMS-envelope or Vault data-key codec also re-checks its wrapping key every ``kek_check_every=``
    seconds (a backend option: default ``MRTR_KEYS_KEK_CHECK_EVERY``, else 300; 0: off) and fails closed
    while it is disabled or denied (`mrtr_keys.codecs.kek`; its ``kek`` attribute). Every token the codec
    refuses is counted in ``mrtr_keys_rejections_total{reason}`` (prometheus-client's default registry).

    With `expect_codec` (``local``, ``kms``, ``vault-transit``; default ``MRTR_KEYS_EXPECT_CODEC``) or a
    KMS key pin (``kms_key_id=``, default ``MRTR_KEYS_KMS_KEY_ID``), a ring of another codec type or KMS
    key is refused: here with `ConfigError`, on reload like an older generation (the last good ring
    stays; `reload_refused` says why). See `mrtr_keys.codecs.pin`.

    Raises:
        KeyRingNotFound, KeystoreError, KeyRingError: no usable ring at `keystore`.
        AudienceError: `audience` outside the ring's scope.
        BackendUnavailable, UnwrapError: the ring's backend cannot give its keys.
        ConfigError: a bad `reload_every`, `heartbeat_every`, `lease`, `max_fenced_out`, `kek_check_every`,
            `instance` or `expect_codec`; a ring the pin refuses; a keyword that neither this function nor any
            backend takes (named with the closest one it takes).
    """
    check_keywords(backend_options, keywords_of(open_codec) | ALL_BACKEND_OPTIONS, "open_codec()")
    from mrtr_keys.codecs.fence import check_lease
    from mrtr_keys.codecs.usage_otel import install
    from mrtr_keys.keystores.watch import DEFAULT_INTERVAL, check_interval, lease_clock

    install()  # the seal counts as OpenTelemetry metrics, once a meter provider is set
    interval = check_interval(DEFAULT_INTERVAL if reload_every is None else reload_every)
    lease = None if lease is None else check_lease(lease)
    max_fenced_out = None if max_fenced_out is None else check_lease(max_fenced_out, "max_fenced_out")
    if "kek_check_every" in backend_options:
        from mrtr_keys.codecs.kek import check_every

        backend_options["kek_check_every"] = check_every(backend_options["kek_check_every"])
    store = as_keystore(keystore)
    loaded_at = lease_clock()
    pin = RingPin.from_settings(expect_codec, backend_options.get("kms_key_id"))
    codec = build_codec(store, audience=audience, observer=observer, pin=pin, **backend_options)
    if callable(getattr(codec, "reload", None)):
        _keep_current(
            codec,
            store,
            observer,
            interval=interval,
            instance=instance,
            heartbeat_every=heartbeat_every,
            lease=lease,
            loaded_at=loaded_at,
            max_fenced_out=max_fenced_out,
        )
    return codec


def build_codec(
    keystore: Keystore,
    *,
    audience: str,
    observer: CodecObserver | None = None,
    pin: RingPin | None = None,
    **backend_options: Any,
) -> Codec:
    """`open_codec` without the watcher and presence (the sidecar, which watches its ring itself).

    With a `pin`, the stored ring is checked before its backend is chosen, and the ring the codec loaded
    is checked again (the keystore may have changed in between); the codec keeps the pin for its reloads.

    Raises:
        ConfigError: the pin refuses the ring; and whatever the backend raises opening its codec.
    """
    ring = keystore.load()
    if pin:
        pin.check(ring)
    backend = backend_for(ring.codec, **backend_options)
    codec = backend.open_codec(keystore, audience=audience, observer=observer)
    if pin:
        loaded = getattr(codec, "ring", None)
        if loaded is not None and loaded is not ring:
            pin.check(loaded)
        with contextlib.suppress(AttributeError):
            codec.pin = pin  # type: ignore[attr-defined]
    return codec


def _keep_current(
    codec: Codec,
    store: Keystore,
    observer: CodecObserver | None,
    *,
    interval: float,
    instance: str | None,
    heartbeat_every: float | None,
    lease: float | None,
    loaded_at: float,
    max_fenced_out: float | None = None,
) -> None:
    """Start the codec's ring watcher, its fence, and its presence heartbeat and seal counts
    (`mrtr_keys.fleet.usage`) when it has an audit store; count its rejections (and its wrapping key's checks) in
    prometheus-client's default registry."""
    from mrtr_keys.keystores.watch import watch_codec

    presence = None
    on_switch = None
    sink = getattr(observer, "sink", None)
    if sink is not None:
        from mrtr_keys.fleet.presence import presence_for

        presence = presence_for(sink.store, name=instance, kind="library", every=heartbeat_every)
        beat, usage = presence.beat_soon, presence.usage()

        def on_switch() -> None:  # a new generation: the heartbeat says so, the counts reserve for its keys
            beat()
            usage.wake()

    watcher = watch_codec(codec, store, interval=interval, on_switch=on_switch)
    with contextlib.suppress(AttributeError):
        codec.watcher = watcher  # type: ignore[attr-defined]
        codec.presence = presence  # type: ignore[attr-defined]
        fence = _fence(codec, store, watcher, presence, interval=interval, lease=lease, loaded_at=loaded_at)
        fence.max_fenced_out = max_fenced_out or None
        fence.on_fenced = getattr(observer, "fenced", None)  # ok events served fenced out carry the reason
        fence.on_served = fenced_out_counter().inc
        codec.fence = fence  # type: ignore[attr-defined]
        codec.on_rejected = count_rejection  # type: ignore[attr-defined]
    if getattr(codec, "kek", None) is not None:
        library_kek_metrics()
    if presence is not None:
        from mrtr_keys.fleet.presence import codec_source, ring_source

        presence.add(codec_source(codec, watcher))
        presence.usage().watch(ring_source(codec))


_fenced_out: Any = None
_fenced_out_lock = threading.Lock()


def fenced_out_counter() -> Any:
    """``mrtr_keys_fenced_out_total`` in prometheus-client's default registry (made once): seals and unseals
    library codecs served on their last good ring after the lease ran out and the keystore check failed
    (`mrtr_keys.codecs.fence`; the sidecar counts its own in ``mrtr_sidecar_fenced_out_total``)."""
    global _fenced_out
    with _fenced_out_lock:
        if _fenced_out is None:
            from prometheus_client import Counter

            _fenced_out = Counter(
                "mrtr_keys_fenced_out",
                "Seals and unseals served on the last good ring after the self-fencing lease ran out and the "
                "keystore check failed (mrtr_keys.codecs.fence).",
            )
        return _fenced_out


_rejections: Any = None
_kek_metrics = False


def count_rejection(reason: str) -> None:
    """Count one refused token in ``mrtr_keys_rejections_total{reason}`` (prometheus-client's default registry;
    the reason codes are the codecs' fixed ones, ``unknown kid``, ``revoked kid``, ...; capped at 32 characters
    like the sidecar's ``mrtr_sidecar_rejections_total``)."""
    global _rejections
    counter = _rejections
    if counter is None:
        with _fenced_out_lock:
            if _rejections is None:
                from prometheus_client import Counter

                _rejections = Counter(
                    "mrtr_keys_rejections", "Tokens library codecs refused, by reason code.", ("reason",)
                )
            counter = _rejections
    counter.labels(reason[:32]).inc()


def library_kek_metrics() -> None:
    """Register, once, the wrapping-key check's metrics in prometheus-client's default registry
    (`mrtr_keys.codecs.kek`): ``mrtr_keys_wrapping_key_checks_total{result}`` and
    ``mrtr_keys_wrapping_key_state`` (the worst of this process's codecs: 0 ok, 1 unreachable, 2 revoked)."""
    global _kek_metrics
    with _fenced_out_lock:
        if _kek_metrics:
            return
        from prometheus_client import REGISTRY

        from mrtr_keys.codecs.kek import KekCollector

        REGISTRY.register(KekCollector("mrtr_keys"))
        _kek_metrics = True


def _fence(
    codec: Codec,
    store: Keystore,
    watcher: Any,
    presence: Any,
    *,
    interval: float,
    lease: float | None,
    loaded_at: float,
) -> Any:
    """The codec's `Fence` over its watcher (or, with reload off, a watcher that is never started)."""
    import weakref

    from mrtr_keys.codecs.fence import Fence, default_lease
    from mrtr_keys.fleet.instances import DEFAULT_HEARTBEAT
    from mrtr_keys.keystores.watch import RingWatcher, WatchedGone

    if lease is None:
        every = presence.every if presence is not None else DEFAULT_HEARTBEAT
        lease = default_lease(every) if interval > 0 else 0.0
    if watcher is None:
        ref = weakref.ref(codec)

        def reload() -> bool:
            target = ref()
            if target is None:
                raise WatchedGone
            return bool(target.reload())

        watcher = RingWatcher(store, reload, interval=0)
    return Fence(watcher, lease=lease, loaded_at=loaded_at)


def request_state_security(
    keystore: Keystore | str | os.PathLike[str] | None = None,
    *,
    audience: str,
    ttl: float = 600.0,
    audit: str | Literal[False] | None = None,
    audit_anchor: str | Literal[False] | None = None,
    audit_anchor_every: float | None = None,
    sidecar: str | None = None,
    secret: str | None = None,
    single_use: str | None = None,
    single_use_for: Iterable[str] | None = None,
    on_store_error: Literal["deny", "allow"] = "deny",
    **options: Any,
) -> RequestStateSecurity:
    """A `RequestStateSecurity(codec=..., audience=..., ttl=...)` for the MCP SDK (`mcp>=2.3`).

    Args:
        keystore: the key ring: a path, ``file:///PATH``, ``vault-kv://MOUNT/PATH`` or ``aws-sm://NAME``
            (docs/keystores.md; default: ``MRTR_KEYS_KEYSTORE``, else ``.mrtr/keyring.json``).
        audience: the audience claim and key scope (usually the MCP server's name).
        ttl: seconds a sealed round stays valid; must not exceed the ring's TTL, which the
            rotation gate (retire after promote + TTL + 60 s) relies on.
        audit: where seals and unseals are recorded (docs/audit.md): None for ``MRTR_KEYS_AUDIT``,
            else the SQLite file ``audit.db`` in the ring's state directory (``MRTR_KEYS_STATE_DIR``);
            a store URL (``sqlite:///PATH``, ``postgresql://...``, ``jsonl:///PATH``); or False for none.
        audit_anchor: where this process anchors the heads of its audit chains, MACed, every
            `audit_anchor_every` seconds (default 300): a file, a directory or ``s3://BUCKET/PREFIX``
            (docs/audit.md, Anchors); None for ``MRTR_KEYS_AUDIT_ANCHOR`` (unset: off), False for off.
        sidecar: seal through a sealing sidecar instead (``http://127.0.0.1:8750`` or
            ``unix:///PATH``; docs/sidecar.md): no key material in this process, `keystore` and `audit`
            unused (the sidecar audits); `secret` is the client's bearer secret (default:
            ``MRTR_KEYS_SIDECAR_SECRET``); `options` go to `SidecarCodec` (``timeout=``). When neither
            `sidecar` nor `keystore` is given, ``MRTR_KEYS_SIDECAR_URL`` (if set) is the sidecar, as in
            deploy/kubernetes/sidecar.yaml; it wins over ``MRTR_KEYS_KEYSTORE``.
        single_use: make rounds single-use (docs/single-use.md): the first unseal of a token consumes it
            across the fleet in this store, ``redis://HOST:PORT/DB`` or ``postgresql://...``.
        single_use_for: only these tools / prompts / resource URIs or URI templates (default: every round).
        on_store_error: ``"deny"`` refuses rounds while the store fails (default); ``"allow"`` serves them.
        options: for a key-ring codec, `open_codec`'s: ``reload_every=`` (seconds between keystore
            checks, default 2, 0 = off), ``instance=`` (presence name), ``heartbeat_every=``
            (seconds, default 10), ``lease=`` (seconds, the self-fencing lease, default 3 heartbeats;
            0 = off), and the backend's client settings.

    Raises:
        ConfigError: `ttl` not positive, or longer than the ring's TTL; a keyword that the chosen codec
            does not take (named with the closest one); and everything `open_codec` raises.
    """
    if not (isinstance(ttl, int | float) and math.isfinite(ttl) and ttl > 0):
        raise ConfigError("ttl must be a positive finite number of seconds")
    if sidecar is None and keystore is None:
        sidecar = os.environ.get(ENV_SIDECAR_URL) or None
    if sidecar is not None:
        from mrtr_keys.codecs.sidecar_client import SidecarCodec, sidecar_security

        valid = keywords_of(request_state_security, SidecarCodec.__init__) - {"url"}
        check_keywords(options, valid, "request_state_security(sidecar=...)")
        security = sidecar_security(sidecar, audience=audience, secret=secret, ttl=float(ttl), **options)
        return with_single_use(security, single_use, single_use_for, on_store_error)
    check_keywords(
        options, keywords_of(request_state_security, open_codec) | ALL_BACKEND_OPTIONS, "request_state_security()"
    )
    if "observer" not in options and audit is not False:
        from mrtr_keys.audit.capture.observer import observer_for

        store = as_keystore(keystore)
        options["observer"] = observer_for(store.directory, audience=audience, audit=audit)
        keystore = store
        sink = getattr(options["observer"], "sink", None)
        if sink is not None and audit_anchor is not False:
            from mrtr_keys.audit.verifying.anchor import anchor_sink, configured

            dest, every = configured(audit_anchor, audit_anchor_every)
            if dest is not None:
                anchor_sink(sink, dest, every)
    deferred = defer_observer(options, single_use)
    codec = open_codec(keystore, audience=audience, **options)
    ring = getattr(codec, "ring", None)
    if ring is not None and ttl > ring.server_ttl_limit:
        from mrtr_keys.ring.model import server_ttl_too_long

        raise ConfigError(server_ttl_too_long(ttl, ring.server_ttl_limit))
    security = RequestStateSecurity(codec=codec, audience=audience, ttl=float(ttl))
    return with_single_use(security, single_use, single_use_for, on_store_error, observer=deferred)
