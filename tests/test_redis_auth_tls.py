"""The Redis tier over AUTH, ACL users and TLS, each against a real redis-server started here:
the right credentials round-trip a block; wrong or missing ones are a miss and a counted error,
never an exception."""

from __future__ import annotations

import pytest
import torch

from kvwise.core.hashing import Namespace, chain_keys
from kvwise.tiers.redis_tier import RedisTier
from tests.redis_launcher import free_port
from tests.redis_servers import start_redis_on, tls_unsupported_reason
from tests.tls_certificates import CertificateAuthority

HMAC_KEY = b"h" * 32


def block(seed: int) -> torch.Tensor:
    return torch.randn(3, 2, 4, 2, 8, generator=torch.Generator().manual_seed(seed))


def round_trips(url: str, tenant: str) -> bool:
    tier = RedisTier(url, hmac_key=HMAC_KEY, encryption_key=b"e" * 32)
    key = chain_keys(list(range(4)), 4, Namespace("m", tenant))[0]
    assert tier.put(key, block(1)), tier.last_error
    return torch.equal(tier.get(key), block(1)) and tier.stats.errors == 0


def refused(url: str, error: str, **options) -> bool:
    """Every call is a miss, with the failure counted and kept in last_error."""
    tier = RedisTier(url, hmac_key=HMAC_KEY, timeout_seconds=2, **options)
    key = chain_keys(list(range(4)), 4, Namespace("m", "refused"))[0]
    missed = tier.put(key, block(2)) is False and tier.get(key) is None and tier.exists(key) is False
    return missed and tier.stats.errors >= 1 and error in tier.last_error


@pytest.mark.timeout(60)
def test_password_auth(tmp_path):
    port = free_port()
    server = start_redis_on(tmp_path, port, "--requirepass", "s3cret pass", password="s3cret pass")
    try:
        assert round_trips(f"redis://:s3cret%20pass@127.0.0.1:{port}/0", "password")
        assert refused(f"redis://:wrong@127.0.0.1:{port}/0", "AuthenticationError")
        assert refused(f"redis://127.0.0.1:{port}/0", "AuthenticationError")
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_acl_user_limited_to_the_tier_keys(tmp_path):
    """The default user is off; `kvwise` may only touch keys under the tier's prefix."""
    port = free_port()
    acl = ["--user", "default", "off", "--user", "kvwise", "on", ">tier-pass", "~kvwise:block:*", "+@all"]
    server = start_redis_on(tmp_path, port, *acl, username="kvwise", password="tier-pass")
    try:
        url = f"redis://kvwise:tier-pass@127.0.0.1:{port}/0"
        assert round_trips(url, "acl")
        assert refused(url, "NoPermissionError", prefix="elsewhere:")  # outside its key pattern
        assert refused(f"redis://kvwise:wrong@127.0.0.1:{port}/0", "AuthenticationError")
        assert refused(f"redis://127.0.0.1:{port}/0", "AuthenticationError")  # the default user
    finally:
        server.stop()


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    reason = tls_unsupported_reason(directory)
    if reason is not None:
        pytest.skip(reason)
    authority = CertificateAuthority(directory / "ca")
    return {
        "ca": authority.files,
        "server": authority.issue("server"),
        "client": authority.issue("client", client=True),
        "stranger": CertificateAuthority(directory / "stranger", "another CA").files,
    }


def tls_server(directory, certificates, authenticate_clients: bool):
    port = free_port()
    server, ca = certificates["server"], certificates["ca"]
    tls = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(server.certificate)]
    tls += ["--tls-key-file", str(server.key), "--tls-ca-cert-file", str(ca.certificate)]
    tls += ["--tls-auth-clients", "yes" if authenticate_clients else "no"]
    client = certificates["client"]
    ping = {"ssl": True, "ssl_ca_certs": str(ca.certificate)}
    if authenticate_clients:
        ping |= {"ssl_certfile": str(client.certificate), "ssl_keyfile": str(client.key)}
    return start_redis_on(directory, port, *tls, **ping)


@pytest.mark.timeout(60)
def test_tls_with_a_verified_server(tmp_path, certificates):
    server = tls_server(tmp_path, certificates, authenticate_clients=False)
    base = f"rediss://127.0.0.1:{server.port}/0?ssl_cert_reqs=required"
    try:
        assert round_trips(f"{base}&ssl_ca_certs={certificates['ca'].certificate}", "tls")
        # a server whose certificate does not chain to the CA we trust is refused
        assert refused(f"{base}&ssl_ca_certs={certificates['stranger'].certificate}", "certificate verify failed")
        assert refused(f"redis://127.0.0.1:{server.port}/0", "ConnectionError")  # plaintext to the TLS port
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_mutual_tls(tmp_path, certificates):
    server = tls_server(tmp_path, certificates, authenticate_clients=True)
    client, ca = certificates["client"], certificates["ca"]
    base = f"rediss://127.0.0.1:{server.port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca.certificate}"
    try:
        assert round_trips(f"{base}&ssl_certfile={client.certificate}&ssl_keyfile={client.key}", "mtls")
        assert refused(base, "ConnectionError")  # no client certificate: the server ends the handshake
    finally:
        server.stop()
