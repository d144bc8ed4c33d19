"""`smg-mlx health`, the exec probe: exit 0 only while the worker reports SERVING,
else 1 with a one-line reason on stderr."""

from __future__ import annotations

import datetime
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from test_security import self_signed

from bench.workers import free_port
from smg_mlx.logs import READY

from docs import README, section
from helpers import wait_until


def health(port: int, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "smg_mlx", "health", "--port", str(port), "--timeout", "5", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )


# A worker whose start-up never ends: its tokenizer never loads. (A FIFO for the
# weights would block MLX's read with the GIL held, freezing the whole process.)
NEVER_READY = """
import sys, threading
import smg_mlx.server
smg_mlx.server.load_tokenizer = lambda model_dir: threading.Event().wait()
from smg_mlx.cli import main
sys.exit(main(sys.argv[1:]))
"""


# The workers probed run in-process (the probe, the command under test, does not).
def test_exit_zero_only_while_serving(start_worker, model_dir):
    port = free_port()
    command = [sys.executable, "-c", NEVER_READY, "serve", "--model", str(model_dir)]
    loading = subprocess.Popen([*command, "--port", str(port)], stderr=subprocess.DEVNULL)
    try:
        serving = start_worker(model_dir)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(60)
        probe = health(port)
    finally:
        loading.kill()
        loading.wait()
    assert (probe.returncode, probe.stdout) == (1, "")
    assert probe.stderr == f"127.0.0.1:{port} reports NOT_SERVING\n"
    # What the README's Quick start says it prints then.
    said = re.search(r"prints `([^`]*NOT_SERVING)` on stderr", section(README, "## Quick start"))
    assert said is not None and said[1].replace("50051", str(port)) + "\n" == probe.stderr

    port = serving.worker.port
    probe = health(port)
    assert (probe.returncode, probe.stdout, probe.stderr) == (0, "SERVING\n", "")
    # Not through a proxy that a unit sets for its downloads (this one is down).
    proxy = f"http://127.0.0.1:{free_port()}"
    proxied = {**os.environ, "http_proxy": proxy, "https_proxy": proxy, "grpc_proxy": proxy}
    probe = health(port, env=proxied)
    assert (probe.returncode, probe.stdout) == (0, "SERVING\n"), probe.stderr

    assert serving.stop() == 0
    probe = health(port)
    assert probe.returncode == 1
    assert probe.stderr.startswith(f"cannot check 127.0.0.1:{port}: UNAVAILABLE")
    assert probe.stderr.count("\n") == 1


def test_tls(start_worker, model_dir, tmp_path):
    cert, key, _ = self_signed(tmp_path)
    port = start_worker(model_dir, tls_cert=cert, tls_key=key).worker.port
    assert wait_until(lambda: health(port, "--tls-ca", str(cert)).returncode == 0, 60)
    plaintext = health(port)
    assert plaintext.returncode == 1
    # gRPC's own reason is "Socket closed": the probe finds out what is wrong.
    assert plaintext.stderr == (
        f"127.0.0.1:{port} serves TLS: pass --tls-ca with the certificate to trust\n"
    )
    # TLS asked of a plaintext worker: the reason, on one line (gRPC logs none of its own).
    plain = start_worker(model_dir).worker.port
    assert wait_until(lambda: health(plain).returncode == 0, 60)
    mismatched = health(plain, "--tls-ca", str(cert))
    assert mismatched.returncode == 1
    assert mismatched.stderr == f"127.0.0.1:{plain} serves plaintext: leave out --tls-ca\n"
    # A certificate the worker's is not: said so, on one line.
    (tmp_path / "other").mkdir()
    other, _, _ = self_signed(tmp_path / "other")
    untrusted = health(port, "--tls-ca", str(other))
    assert untrusted.returncode == 1
    assert untrusted.stderr.startswith(
        f"cannot check 127.0.0.1:{port}: its certificate is not one --tls-ca {other} trusts"
    )
    assert len(untrusted.stderr.splitlines()) == 1, untrusted.stderr
    # The probe told wrong: 2, which no restart of the worker cures.
    for wrong, said in ((tmp_path / "none.pem", "No such file"), (key, "holds no PEM certificate")):
        told = health(port, "--tls-ca", str(wrong))
        assert told.returncode == 2 and said in told.stderr, told.stderr


def test_an_ipv6_address_is_served_and_probed_bare_or_in_brackets(start_worker, model_dir, caplog):
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    metrics = free_port()
    caplog.set_level(logging.INFO, READY)
    port = start_worker(model_dir, host="::1", metrics_port=metrics).worker.port
    assert wait_until(lambda: health(port, "--host", "::1").returncode == 0, 60)
    assert health(port, "--host", "[::1]").returncode == 0
    assert f"on [::1]:{port}, ready in" in caplog.text
    with urllib.request.urlopen(f"http://[::1]:{metrics}/metrics", timeout=10) as page:
        assert b"smg_mlx_" in page.read()


def test_a_certificate_that_expired_while_served_is_named(tmp_path):
    """The worker refuses an expired certificate at start-up, but one may expire
    while it serves: the probe says so, not that --tls-ca does not trust it."""
    day = datetime.timedelta(days=1)
    cert, key, cert_pem = self_signed(tmp_path, (-3 * day, -day))
    server = grpc.server(futures.ThreadPoolExecutor(1))
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert_pem)])
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        probe = health(port, "--tls-ca", str(cert))
    finally:
        server.stop(0)
    assert probe.returncode == 1
    assert probe.stderr.startswith(
        f"cannot check 127.0.0.1:{port}: its certificate has expired: renew the worker's "
        "--tls-cert ("
    ), probe.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_probe_stopped_before_an_answer_is_no_verdict_of_serving(sig):
    """A supervisor's probe timeout signals the probe: that is not SERVING."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes connections, says nothing
        port = silent.getsockname()[1]
        command = [sys.executable, "-m", "smg_mlx", "health", "--port", str(port)]
        probe = subprocess.Popen(
            [*command, "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        silent.settimeout(30)
        connection, _ = silent.accept()  # the probe is waiting for its answer
        with connection:
            probe.send_signal(sig)
            out, err = probe.communicate(timeout=30)
    assert (probe.returncode, out) == (1, "")
    assert err == f"stopped by {sig.name} before an answer\n"


def test_a_port_that_answers_but_not_in_grpc_is_named(tmp_path):
    """The router's HTTP port or the metrics port given by mistake: a hint, not
    only gRPC's words about HTTP/2 frames."""
    http = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        probe = health(http.server_port)
    finally:
        http.shutdown()
    assert probe.returncode == 1
    assert probe.stderr.endswith(f" (is {http.server_port} a worker's --port?)\n"), probe.stderr
    # Asked for TLS too, it says the same, not that the port is a plaintext worker's.
    http = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        probe = health(http.server_port, "--tls-ca", str(self_signed(tmp_path)[0]))
    finally:
        http.shutdown()
    assert probe.returncode == 1
    assert probe.stderr.endswith(f" (is {http.server_port} a worker's --port?)\n"), probe.stderr


def test_a_probe_told_no_host_is_refused_as_told_wrong():
    """Exit 2, as for every probe told wrong: no restart of the worker cures it."""
    done = health(free_port(), "--host", "")
    assert done.returncode == 2
    assert "--host: expected a host name or address (such as 127.0.0.1), got ''" in done.stderr
    # Nor one given a port in its --host (it probed "[127.0.0.1:50075]:50051", exit 1).
    done = health(free_port(), "--host", "127.0.0.1:50075")
    assert done.returncode == 2
    assert "address without a port (give the port with --port), got '127.0.0.1:50075'" in (
        done.stderr
    )
