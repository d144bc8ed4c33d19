"""Security basics: loopback by default, optional TLS, GetTokenizer serves tokenizer files only."""

from __future__ import annotations

import datetime
import io
import ipaddress
import shutil
import zipfile

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smg_mlx.cli import build_parser
from smg_mlx.grpc_stubs import common_pb2, mlx_engine_pb2_grpc

from helpers import SERVING, generate, prompt, wait_until


def test_default_host_is_loopback():
    args = build_parser().parse_args(["serve", "--demo"])
    assert args.host == "127.0.0.1"


def self_signed(tmp_path, valid=(-datetime.timedelta(minutes=5), datetime.timedelta(days=1))):
    """A certificate (valid from now + valid[0] to now + valid[1]) and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "smg-mlx test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + valid[0])
        .not_valid_after(now + valid[1])
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return tmp_path / "cert.pem", tmp_path / "key.pem", cert_pem


def test_tls_with_a_self_signed_certificate(spawn, model_dir, tmp_path):
    cert, key, cert_pem = self_signed(tmp_path)
    p = spawn("--model", str(model_dir), "--tls-cert", str(cert), "--tls-key", str(key))
    channel = grpc.secure_channel(f"127.0.0.1:{p.port}", grpc.ssl_channel_credentials(cert_pem))
    health = health_pb2_grpc.HealthStub(channel)
    grpc.channel_ready_future(channel).result(60)

    def serving():
        return health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING

    assert wait_until(serving, 60), p.log.read_text()
    stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
    assert len(generate(stub, prompt(4), max_tokens=3).tokens) == 3
    # A plaintext client cannot talk to a TLS port.
    with pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(p.channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tls-cert", "cert.pem"], "needs both --tls-cert and --tls-key"),
        (
            ["--tls-cert", "missing.pem", "--tls-key", "key.pem"],
            "--tls-cert TMP/missing.pem is not a readable file",
        ),
        (
            ["--tls-cert", "garbage.pem", "--tls-key", "garbage.pem"],
            "--tls-cert TMP/garbage.pem holds no PEM certificate",
        ),
        (
            ["--tls-cert", "key.pem", "--tls-key", "cert.pem"],
            "--tls-cert TMP/key.pem holds no PEM certificate (-----BEGIN CERTIFICATE-----): "
            "it holds a private key; are --tls-cert and --tls-key swapped?",
        ),
        (
            ["--tls-cert", "cert.pem", "--tls-key", "garbage.pem"],
            "--tls-key TMP/garbage.pem holds no PEM private key",
        ),
        (
            ["--tls-cert", "cert.pem", "--tls-key", "other/key.pem"],
            "--tls-key TMP/other/key.pem is not the private key of --tls-cert TMP/cert.pem",
        ),
        (
            ["--tls-cert", "expired/cert.pem", "--tls-key", "expired/key.pem"],
            "--tls-cert TMP/expired/cert.pem has expired: every client would refuse it; renew it",
        ),
        (
            ["--tls-cert", "future/cert.pem", "--tls-key", "future/key.pem"],
            "--tls-cert TMP/future/cert.pem is not valid yet (its start date is ahead of this "
            "machine's clock)",
        ),
    ],
    ids=[
        "cert without key", "missing file", "not PEM", "swapped", "not a key", "another's key",
        "expired", "not yet valid",
    ],
)  # fmt: skip
def test_bad_tls_settings_are_refused_with_exit_two(spawn, model_dir, tmp_path, args, message):
    self_signed(tmp_path)
    day = datetime.timedelta(days=1)
    for name, valid in (("other", None), ("expired", (-3 * day, -day)), ("future", (day, 3 * day))):
        (tmp_path / name).mkdir()
        self_signed(tmp_path / name, *([valid] if valid else []))
    (tmp_path / "garbage.pem").write_text("not a certificate")
    p = spawn(
        "--model", str(model_dir), *[str(tmp_path / a) if a.endswith(".pem") else a for a in args]
    )
    assert p.proc.wait(60) == 2
    assert message.replace("TMP", str(tmp_path)) in p.log.read_text()
    assert "cannot listen" not in p.log.read_text()


def tokenizer_names(worker_stub) -> dict[str, bytes]:
    data = b"".join(c.data for c in worker_stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    archive = zipfile.ZipFile(io.BytesIO(data))
    return {name: archive.read(name) for name in archive.namelist()}


def test_tokenizer_bundle_never_follows_links_out_of_the_model(
    start_worker, model_dir, tmp_path, caplog
):
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    secret = tmp_path / "secret.txt"
    secret.write_text("do not serve me")
    # Listed names that point outside the model directory, or at a non-tokenizer file.
    (model / "tiktoken.model").symlink_to(secret)
    (model / "merges.txt").symlink_to(model / "model.safetensors")
    (model / "vocab.txt").symlink_to("/etc/passwd")
    (model / "special_tokens_map.json").mkdir()
    (model / "tokenizer.model").symlink_to(model / "nowhere")
    w = start_worker(model)
    files = tokenizer_names(w.stub)
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "config.json"}
    assert files["tokenizer.json"] == (model_dir / "tokenizer.json").read_bytes()
    # Each left out with its reason, as the log says (the first: a file linked in from outside).
    said = {r.getMessage().split(": ", 1)[0].rsplit("/", 1)[-1]: r.getMessage().split(": ", 1)[1]
            for r in caplog.records if r.getMessage().startswith("not serving")}  # fmt: skip
    assert said == {
        "tiktoken.model": f"it links to {secret}, outside the model directory (links are "
        "followed only within it: copy the file in)",
        "merges.txt": "it links to model.safetensors, which is not a tokenizer file",
        "vocab.txt": "it links to /etc/passwd, outside the model directory (links are "
        "followed only within it: copy the file in)",
        "special_tokens_map.json": "it is not a regular file",
        "tokenizer.model": "its link leads to no file",
    }


def test_a_bundle_without_a_vocabulary_is_refused_with_what_to_fix(
    start_worker, model_dir, tmp_path
):
    """A model directory of links to files kept elsewhere: the worker reads its
    tokenizer, but GetTokenizer may hand out none of it. The router is told
    why, not given an archive it cannot tokenize with."""
    model = tmp_path / "linked"
    model.mkdir()
    for f in model_dir.iterdir():
        (model / f.name).symlink_to(f)
    w = start_worker(model)
    assert generate(w.stub, prompt(5), max_tokens=2).tokens  # serving all the same
    with pytest.raises(grpc.RpcError) as err:
        tokenizer_names(w.stub)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == (
        f"{model} has no tokenizer vocabulary GetTokenizer may serve (tokenizer.json: it "
        f"links to {model_dir / 'tokenizer.json'}, outside the model directory (links are "
        "followed only within it: copy the file in); tokenizer_config.json: it links to "
        f"{model_dir / 'tokenizer_config.json'}, outside the model directory (links are "
        "followed only within it: copy the file in); config.json: it links to "
        f"{model_dir / 'config.json'}, outside the model directory (links are followed only "
        "within it: copy the file in)): copy the tokenizer files into the model directory"
    )


def test_tokenizer_files_in_a_hub_cache_snapshot_are_served(start_worker, model_dir, tmp_path):
    # Hugging Face's cache keeps files in blobs/ and symlinks them from snapshots/<rev>/.
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in model_dir.iterdir():
        blob = blobs / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(f"../../blobs/{blob.name}")
    w = start_worker(snapshot)
    files = tokenizer_names(w.stub)
    assert files["tokenizer.json"] == (model_dir / "tokenizer.json").read_bytes()
    assert "config.json" in files


def test_the_tokenizer_bundle_is_the_one_read_at_start_up(start_worker, model_dir, tmp_path):
    """A model directory moved or deleted while the worker runs (a remount, a
    cache cleaned) leaves the bundle a router fetches as it was, not empty."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    w = start_worker(model)
    model.rename(tmp_path / "moved")
    files = tokenizer_names(w.stub)
    assert files["tokenizer.json"] == (model_dir / "tokenizer.json").read_bytes()
    assert {"tokenizer_config.json", "config.json"} <= set(files)
