"""`mrtr-keys init`: create a key ring with one primary key."""

from __future__ import annotations

from typing import Annotated

import typer

from mrtr_keys.cli.options import JsonOpt, KeyFormatOpt, KeystoreOpt, change_listeners, keystore
from mrtr_keys.errors import ConfigError


def init(
    keystore_: KeystoreOpt = None,
    codec: Annotated[str, typer.Option("--codec", help="local, kms or vault-transit.")] = "local",
    ttl: Annotated[float, typer.Option("--ttl", help="requestState TTL in seconds (the retire gate).")] = 600.0,
    audience: Annotated[
        list[str] | None, typer.Option("--audience", help="Audience scope (repeat); none means any.")
    ] = None,
    kms_key_id: Annotated[str | None, typer.Option("--kms-key-id", help="KMS key ARN (--codec kms).")] = None,
    transit_key: Annotated[
        str | None, typer.Option("--transit-key", help="Transit key name (--codec vault-transit).")
    ] = None,
    mode: Annotated[str | None, typer.Option("--mode", help="remote or datakey (--codec vault-transit).")] = None,
    mount: Annotated[str | None, typer.Option("--mount", help="Transit mount path (--codec vault-transit).")] = None,
    from_sdk_key_file: Annotated[
        str | None,
        typer.Option(
            "--from-sdk-key-file",
            help="Start from the key(s) of the MCP SDK's RequestStateSecurity(keys=[...]) in this file "
            "(local rings; docs/migration.md).",
        ),
    ] = None,
    encoding: Annotated[
        str | None,
        typer.Option("--encoding", help="hex or base64: the key file holds one key a line in it (default: raw)."),
    ] = None,
    key_format: KeyFormatOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Create a new key ring with one primary key; refuses if one exists there."""
    from mrtr_keys.changes.create import create_ring, create_ring_from_sdk_keys
    from mrtr_keys.cli.output import print_json, print_line
    from mrtr_keys.ring.model import CodecSpec
    from mrtr_keys.ring.sdk_keys import read_sdk_key_file

    if encoding is not None and from_sdk_key_file is None:
        raise ConfigError("--encoding describes the --from-sdk-key-file; give that file too")
    if from_sdk_key_file is not None and codec != "local":
        raise ConfigError(
            f"--from-sdk-key-file starts a local key ring only; a {codec} ring's keys are made and wrapped by "
            "its service (start a local ring from the SDK key, then move codecs after its rotation)"
        )
    if key_format is not None and from_sdk_key_file is not None:
        raise ConfigError("--key-format is for a new key; --from-sdk-key-file keeps the SDK's own (sdk-v1)")

    params: dict[str, object] = {}
    if kms_key_id is not None:
        params["kms_key_id"] = kms_key_id
    if transit_key is not None:
        params["key"] = transit_key
    if mode is not None:
        params["mode"] = mode
    if mount is not None:
        params["mount"] = mount
    store = keystore(keystore_)
    if from_sdk_key_file is not None:
        secrets = read_sdk_key_file(from_sdk_key_file, encoding)
        result = create_ring_from_sdk_keys(
            store, secrets, ttl=ttl, audiences=audience or (), listeners=change_listeners()
        )
    else:
        result = create_ring(
            store,
            codec=CodecSpec(codec, params),
            ttl=ttl,
            audiences=audience or (),
            listeners=change_listeners(),
            key_format=key_format,
        )
    ring = result.ring
    if json_:
        print_json(
            {
                "kid": ring.primary.kid,
                "format": ring.primary.format.value,
                "keys": [{"kid": k.kid, "state": k.state.value, "format": k.format.value} for k in ring.keys],
                "ring_id": ring.ring_id,
                "generation": ring.generation,
                "codec": ring.codec.type,
                "keystore": store.url,
                "ttl_seconds": ring.ttl_seconds,
                "audiences": list(ring.audiences),
            }
        )
    else:
        print_line(f"created key ring {ring.ring_id} at {store.url}")
        print_line(f"primary key: {ring.primary.kid}" + _format_note(ring.primary.format.value))
        if ring.primary.format.value == "mk2":
            print_line("mrtr-keys 0.2.0 or later reads this ring (key format mk2; docs/rotation.md, 'Upgrading')")
        for k in ring.keys[1:]:
            print_line(f"{k.state.value} key: {k.kid}" + _format_note(k.format.value))


def _format_note(key_format: str) -> str:
    return " (MCP SDK format: v1. tokens)" if key_format == "sdk-v1" else ""
