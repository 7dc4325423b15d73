"""`mrtr-keys init`: create a key ring with one primary key."""

from __future__ import annotations

from typing import Annotated

import typer

from mrtr_keys.cli.options import JsonOpt, KeystoreOpt, keystore


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
    json_: JsonOpt = False,
) -> None:
    """Create a new key ring with one primary key; refuses if one exists there."""
    from mrtr_keys.cli.output import print_json, print_line
    from mrtr_keys.ring.create import create_ring
    from mrtr_keys.ring.model import CodecSpec

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
    result = create_ring(store, codec=CodecSpec(codec, params), ttl=ttl, audiences=audience or ())
    ring = result.ring
    if json_:
        print_json(
            {
                "kid": ring.primary.kid,
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
        print_line(f"primary key: {ring.primary.kid}")
