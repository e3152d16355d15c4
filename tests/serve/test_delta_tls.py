"""The delta channel under Ray's TLS settings, on loopback without Ray: contexts from Ray's
certificates, a TLS round trip, a plain TCP peer and a foreign certificate refused."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from app.serve.channel.delta_auth import tls_contexts
from app.serve.channel.delta_inbox import DeltaInbox
from app.serve.channel.delta_outbox import DeltaOutbox
from app.serve.channel.delta_wire import (
    ChannelLimits,
    DeltaChannelError,
)
from serve.delta_peers import connect, hung_up, still_serves


def _certificates(folder, name: str = "node", ca: str = "ca") -> dict[str, str]:
    """A CA and a node certificate it signed (EC P-256, a day), made with the openssl CLI."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca_key, ca_crt = folder / f"{ca}.key", folder / f"{ca}.crt"
    key, csr, crt, ext = (folder / f"{name}.{x}" for x in ("key", "csr", "crt", "ext"))
    ext.write_text("basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1\n")
    if not ca_crt.exists():
        run = ["openssl", "req", "-x509", *ec, "-keyout", ca_key, "-out", ca_crt]
        subprocess.run([*run, "-days", "1", "-subj", f"/CN={ca}"], check=True, capture_output=True)
    run = ["openssl", "req", *ec, "-keyout", key, "-out", csr, "-subj", f"/CN={name}"]
    subprocess.run(run, check=True, capture_output=True)
    run = ["openssl", "x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-days", "1"]
    subprocess.run([*run, "-CAcreateserial", "-extfile", ext, "-out", crt], check=True)
    return {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(crt),
        "RAY_TLS_SERVER_KEY": str(key),
        "RAY_TLS_CA_CERT": str(ca_crt),
    }


@pytest.fixture
def ray_tls(tmp_path, monkeypatch):
    env = _certificates(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def test_tls_contexts_follow_rays_settings(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    assert tls_contexts() is None
    monkeypatch.setenv("RAY_USE_TLS", "true")
    monkeypatch.delenv("RAY_TLS_CA_CERT", raising=False)
    with pytest.raises(RuntimeError, match="RAY_TLS_"):
        tls_contexts()


def test_under_ray_tls_the_channel_is_tls_with_rays_certificates(ray_tls):
    """A round trip with both ends on the CA's certificates; the inbox's side of the
    connection is TLS. Seen failing (ssl_object None) with the inbox skipping start_tls."""

    async def main():
        inbox = await DeltaInbox.start()
        served = await still_serves(inbox, "a")
        link = await DeltaOutbox().link(inbox.reply_to)
        (peer,) = inbox._peers
        tls = peer.get_extra_info("ssl_object") is not None
        link.close()
        await inbox.stop()
        return served, tls

    assert asyncio.run(main()) == (True, True)


def test_under_ray_tls_a_plain_tcp_peer_and_a_foreign_certificate_are_refused(
    ray_tls, tmp_path, monkeypatch
):
    """A replica without TLS, raw garbage, and a replica whose certificate another CA
    signed (holding the right secret): none gets a link. Seen failing: with CERT_NONE on
    the server context the foreign certificate was served."""

    async def main():
        inbox = await DeltaInbox.start(limits=ChannelLimits(handshake_s=0.5))
        monkeypatch.setenv("RAY_USE_TLS", "0")
        with pytest.raises(DeltaChannelError, match="handshake"):
            await DeltaOutbox().link(inbox.reply_to)
        reader, writer = await connect(inbox)
        writer.write(os.urandom(512))
        closed = await hung_up(reader, 2.0)
        writer.close()
        other = _certificates(tmp_path, "stranger", "other-ca")
        for name, value in {**other, "RAY_TLS_CA_CERT": ray_tls["RAY_TLS_CA_CERT"]}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(DeltaChannelError, match="handshake"):
            await DeltaOutbox().link(inbox.reply_to)
        refused = inbox.refused
        await inbox.stop()
        return closed, refused

    closed, refused = asyncio.run(main())
    assert closed and refused == 3
