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
    for flag, pem in (("--tls-cert", cert), ("--tls-key", key)):
        if not pem.is_file():
            return f"{flag} {pem} is not a readable file"
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
    return _out_of_date(cert, key)


# OpenSSL's verification codes for a certificate outside its validity dates.
_EXPIRED, _NOT_YET_VALID = 10, 9


def _out_of_date(cert: Path, key: Path) -> str | None:
    """Why `cert` would fail every client for its dates, from a handshake with
    itself in memory (a client trusting it alone): gRPC serves it regardless."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a CA's leaf as its own anchor
    client.load_verify_locations(cafile=cert)
    wires = [ssl.MemoryBIO() for _ in range(4)]
    ends = [client.wrap_bio(wires[0], wires[1]), server.wrap_bio(wires[2], wires[3], True)]
    try:
        for _ in range(8):  # a few round trips finish a handshake
            done = 0
            for end in ends:
                try:
                    end.do_handshake()
                    done += 1
                except ssl.SSLWantReadError:
                    pass
            wires[2].write(wires[1].read())
            wires[0].write(wires[3].read())
            if done == 2:
                return None
    except ssl.SSLCertVerificationError as exc:
        if exc.verify_code == _EXPIRED:
            return f"--tls-cert {cert} has expired: every client would refuse it; renew it"
        if exc.verify_code == _NOT_YET_VALID:
            return (
                f"--tls-cert {cert} is not valid yet (its start date is ahead of this machine's "
                "clock): every client would refuse it"
            )
    except ssl.SSLError:
        pass  # other failures are the clients' to judge (their trust, their names)
    return None
