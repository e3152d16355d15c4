"""Who may use the delta channel: TLS with Ray's certificates when Ray runs with TLS, then
a mutual HMAC-SHA256 challenge-response from the inbox's secret.

The secret (SECRET_BYTES random bytes, made by the inbox at start) reaches replicas only
inside Ray, in `ReplyTo`, an argument of the Serve handle call; neither it nor anything
that replays is ever sent on the channel. Each side proves it holds the secret over both
sides' fresh nonces, with a label per direction so a proof cannot be reflected back:

    inbox   -> replica   hello(nonce_i)
    replica -> inbox     prove(nonce_r, HMAC(secret, b"replica" + nonce_i + nonce_r))
    inbox   -> replica   proof(HMAC(secret, b"ingress" + nonce_r + nonce_i))

Each side's whole handshake (TLS included) must finish within ChannelLimits.handshake_s.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import ssl

from app.serve.channel import delta_codec as codec
from app.serve.channel.delta_wire import (
    HANDSHAKE_FRAME_BYTES,
    DeltaChannelError,
    pack_frame,
    read_message,
)

SECRET_BYTES = 32


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
    """(server, client) contexts from Ray's TLS settings, or None when Ray runs without TLS.
    The inbox requires a client certificate signed by Ray's CA; the replica checks the
    inbox's certificate against that CA. Hostnames are not checked: peers are node IPs, as
    in Ray's own gRPC."""
    if os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
        return None
    try:
        cert, key, ca = (
            os.environ[name]
            for name in ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")
        )
    except KeyError as e:
        raise RuntimeError(f"RAY_USE_TLS is set but {e.args[0]} is not") from None
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    server.load_cert_chain(cert, key)
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    client.check_hostname = False  # verify_mode stays CERT_REQUIRED
    client.load_cert_chain(cert, key)
    return server, client


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


async def challenge_replica(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes
) -> None:
    """The inbox's side (inside the caller's handshake deadline): DeltaChannelError unless
    the peer proves it holds ``secret``; then proves the inbox holds it too."""
    nonce_i = secrets.token_bytes(codec.NONCE_BYTES)
    writer.write(pack_frame(["hello", codec.VERSION, nonce_i]))
    nonce_r, mac = codec.decode_prove(await _handshake_message(reader))
    if not hmac.compare_digest(mac, _mac(secret, b"replica", nonce_i, nonce_r)):
        raise DeltaChannelError("a delta channel peer failed the challenge")
    writer.write(pack_frame(["proof", _mac(secret, b"ingress", nonce_r, nonce_i)]))
    await writer.drain()


async def answer_ingress(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes
) -> None:
    """The replica's side: answers the inbox's challenge, then DeltaChannelError unless the
    inbox proves it holds ``secret`` (a stale or squatted address cannot take deltas)."""
    nonce_i = codec.decode_hello(await _handshake_message(reader))
    nonce_r = secrets.token_bytes(codec.NONCE_BYTES)
    writer.write(pack_frame(["prove", nonce_r, _mac(secret, b"replica", nonce_i, nonce_r)]))
    mac = codec.decode_proof(await _handshake_message(reader))
    if not hmac.compare_digest(mac, _mac(secret, b"ingress", nonce_r, nonce_i)):
        raise DeltaChannelError("the ingress inbox failed the challenge")


async def _handshake_message(reader: asyncio.StreamReader) -> list:
    message = await read_message(reader, HANDSHAKE_FRAME_BYTES)
    if message is None:
        raise DeltaChannelError("the delta channel peer hung up in the handshake")
    return message
