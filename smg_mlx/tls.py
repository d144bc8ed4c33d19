"""`--tls-cert` and `--tls-key`, checked before the worker listens: gRPC refuses
a bad pair with no reason (its bind just fails), so Python's ssl module, which
reads the same PEM files, tells which file is wrong and why."""

from __future__ import annotations

import ssl
from pathlib import Path


class _Encrypted(Exception):
    """The key asks for a passphrase (which gRPC cannot give)."""


def _no_passphrase() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal, and start-up would hang.
    raise _Encrypted


def problem(cert: Path | None, key: Path | None) -> str | None:
    """Why the worker cannot serve TLS with `cert` and `key` (both None: plaintext);
    None when it can."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        return "TLS needs both --tls-cert and --tls-key"
    for pem in (cert, key):
        if not pem.is_file():
            return f"{pem} is not a readable file"
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert)
    except (ssl.SSLError, ValueError):
        swapped = b"PRIVATE KEY-----" in cert.read_bytes()
        return f"--tls-cert {cert} holds no PEM certificate (-----BEGIN CERTIFICATE-----)" + (
            ": it holds a private key; are --tls-cert and --tls-key swapped?" if swapped else ""
        )
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, _no_passphrase)
    except _Encrypted:
        return f"--tls-key {key} is encrypted: give the key without a passphrase"
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            return f"--tls-key {key} is not the private key of --tls-cert {cert}"
        return f"--tls-key {key} holds no PEM private key (-----BEGIN ... PRIVATE KEY-----)"
    return None
