"""`--model` takes a Hugging Face repo id: served from the local cache, or
downloaded into it. No test reaches the network: the cache is built here, and
downloads come from a stand-in for the Hub on loopback."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest

from bench.workers import free_port
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.model_source import EXAMPLE, ModelNotFound, resolve

from helpers import NOT_SERVING, generate, prompt, wait_until

REPO_ID = "org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(hf_home: Path, repo_id: str, model_dir: Path) -> Path:
    """Lay `model_dir` out as Hugging Face's cache does; returns the snapshot directory."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot, blobs = repo / "snapshots" / COMMIT, repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for f in model_dir.iterdir():
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(f"../../blobs/{blob.name}")
    return snapshot


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face home, offline; workers spawned by the test inherit it."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    return home


class FakeHub:
    """The few Hub routes a snapshot download uses, serving one repo's files;
    with `stall`, the weights never finish arriving."""

    def __init__(self, model_dir: Path, stall: bool = False) -> None:
        files = {f.name: f.read_bytes() for f in model_dir.iterdir()}
        release = self.release = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def send(self, body: bytes, headers: dict[str, str], head: bool) -> None:
                self.send_response(200)
                for key, value in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if head:
                    return
                if stall and body == files["model.safetensors"]:
                    self.wfile.write(body[:1000])
                    self.wfile.flush()
                    release.wait()
                    return
                self.wfile.write(body)

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                self.do_GET(head=True)

            def do_GET(self, head: bool = False) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?")[0]
                if path == f"/api/models/{REPO_ID}/revision/main":
                    body = {
                        "id": REPO_ID,
                        "sha": COMMIT,
                        "siblings": [{"rfilename": n} for n in files],
                    }
                elif path.startswith(f"/api/models/{REPO_ID}/tree/"):
                    body = [
                        {
                            "type": "file",
                            "path": n,
                            "size": len(b),
                            "oid": hashlib.sha1(b).hexdigest(),
                        }
                        for n, b in files.items()
                    ]
                elif path.startswith(f"/{REPO_ID}/resolve/{COMMIT}/"):
                    data = files[path.rsplit("/", 1)[1]]
                    etag = f'"{hashlib.sha1(data).hexdigest()}"'
                    return self.send(data, {"ETag": etag, "X-Repo-Commit": COMMIT}, head)
                else:
                    self.send_error(404)
                    return
                return self.send(
                    json.dumps(body).encode(), {"Content-Type": "application/json"}, head
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """Start a FakeHub and point spawned workers at it, online."""
    hubs: list[FakeHub] = []

    def start(model_dir: Path, stall: bool = False) -> FakeHub:
        hubs.append(FakeHub(model_dir, stall))
        monkeypatch.setenv("HF_ENDPOINT", hubs[-1].url)
        monkeypatch.delenv("HF_HUB_OFFLINE")
        return hubs[-1]

    yield start
    for hub in hubs:
        hub.close()


def test_a_cached_repo_id_is_served_offline(spawn, model_dir, hf_home):
    snapshot = hub_cache(hf_home, REPO_ID, model_dir)
    p = spawn("--model", REPO_ID)
    p.wait_serving()
    info = p.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.served_model_name, info.model_path) == ("tiny-llama", str(snapshot))
    assert len(generate(p.stub, prompt(8), max_tokens=2).tokens) == 2
    # The router's --model-path needs a directory: the log names it.
    assert f"{REPO_ID} is in {snapshot}" in p.log.read_text()


def serve_absent_repo() -> subprocess.CompletedProcess:
    """A worker asked for a repo that the cache lacks, run to its end."""
    return subprocess.run(
        [sys.executable, "-m", "smg_mlx", "serve", "--model", "org/absent", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_absent_repo_id_offline_says_what_to_do(hf_home):
    done = serve_absent_repo()
    assert done.returncode == 2
    assert "org/absent is not in the Hugging Face cache" in done.stderr
    assert "HF_HUB_OFFLINE is set" in done.stderr and "hf download org/absent" in done.stderr
    # A relative path without its "./" reads as a repo id: said too.
    assert "nor is there a local directory org/absent: a path is written ./org/absent" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr


def test_an_absent_repo_id_is_downloaded_with_progress_in_the_log(spawn, model_dir, fake_hub):
    fake_hub(model_dir)
    p = spawn("--model", REPO_ID)
    p.wait_serving()
    assert p.stub.GetModelInfo(pb.GetModelInfoRequest()).served_model_name == "tiny-llama"
    log = p.log.read_text()
    assert f"downloading {REPO_ID} from the Hugging Face Hub" in log
    assert "download progress: " in log and f"downloaded {REPO_ID}" in log
    assert "HTTP Request" not in log  # the HTTP client's line per request
    assert "Traceback" not in log


def test_a_downloading_worker_answers_not_serving_and_a_signal_ends_it_at_once(
    spawn, model_dir, fake_hub
):
    fake_hub(model_dir, stall=True)
    p = spawn("--model", REPO_ID)
    assert wait_until(lambda: "download progress" in p.log.read_text(), 60), p.log.read_text()
    # Probes and the router see a worker starting, not a closed port.
    assert p.check() == NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        p.stub.HealthCheck(pb.HealthCheckRequest())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "still loading" in err.value.details()
    # The download's threads are stuck reading: the process must not wait for them.
    assert p.stop(signal.SIGTERM, timeout=10) == 0


def test_an_unreachable_hub_exits_one_with_the_reason_on_one_line(hf_home, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    done = serve_absent_repo()
    assert done.returncode == 1
    (error,) = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert "cannot download org/absent from http://127.0.0.1:" in error
    assert "hf download org/absent" in error
    assert "\\n" not in error  # the Hub's message spans lines; the log line must not show it
    # ... and its lines are sentences: joined, they still read as two.
    assert "Connection refused. An error happened" in error
    assert "Traceback" not in done.stderr


def test_a_cache_that_cannot_be_written_is_named_not_the_network(
    model_dir, fake_hub, tmp_path, monkeypatch
):
    fake_hub(model_dir)
    home = tmp_path / "a-file"
    home.write_text("")
    monkeypatch.setenv("HF_HOME", str(home))
    done = subprocess.run(
        [sys.executable, "-m", "smg_mlx", "serve", "--model", REPO_ID, "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2  # a person fixes it: no restart cures it
    (error,) = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert f"cannot download {REPO_ID} into the Hugging Face cache ({home}/hub): " in error
    assert "Not a directory" in error and "point HF_HOME at a directory" in error
    assert "check the network" not in error and "Traceback" not in done.stderr


def test_a_local_path_wins_over_a_repo_id(model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "tiny-llama").symlink_to(model_dir)
    source = resolve(REPO_ID)
    assert (source.path, source.served_name) == (tmp_path / REPO_ID, None)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("empty-dir", "empty-dir is not a model directory (no config.json)"),
        ("no/such/dir", "not a model directory (no such path), nor a Hugging Face repo id"),
        ("typo", "not a model directory (no such path), nor a Hugging Face repo id"),
    ],
)
def test_what_is_neither_says_so(name, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(ModelNotFound, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(name)


def test_a_file_in_a_model_directory_names_the_directory(model_dir, tmp_path):
    config = model_dir / "config.json"
    with pytest.raises(ModelNotFound) as err:
        resolve(str(config))
    assert str(err.value).startswith(
        f"{config} is a file, not a model directory: pass its directory, {model_dir}"
    )
    # A file elsewhere: its folder is no model either, so it is not the hint.
    stray = tmp_path / "notes.txt"
    stray.write_text("")
    with pytest.raises(ModelNotFound) as err:
        resolve(str(stray))
    assert str(err.value) == (
        f"{stray} is a file, not a model directory: pass an mlx-lm model directory or a "
        f"Hugging Face repo id such as {EXAMPLE}"
    )


def test_a_revision_names_the_snapshot_to_serve(hf_home, model_dir, monkeypatch):
    from huggingface_hub import constants

    # The Hub's settings are read when it is first imported, maybe by an earlier test.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    main = hub_cache(hf_home, REPO_ID, model_dir)
    tagged = main.parent / "fedcba9876543210fedcba9876543210fedcba98"
    shutil.copytree(main, tagged, symlinks=True)
    (main.parent.parent / "refs" / "v1").write_text(tagged.name)
    assert resolve(REPO_ID).path == main
    assert resolve(REPO_ID, "v1").path == tagged
    assert resolve(REPO_ID, tagged.name).path == tagged
    absent = f"{REPO_ID} at revision v2 is not in the Hugging Face cache"
    with pytest.raises(ModelNotFound, match=absent) as err:
        resolve(REPO_ID, "v2")
    assert f"hf download {REPO_ID} --revision v2" in str(err.value)
    with pytest.raises(ModelNotFound, match="is a local directory: --revision names a version"):
        resolve(str(model_dir), "v1")


def partial_copy(model_dir: Path, to: Path) -> Path:
    """`model_dir` without its weights, as a tool that fetched its config and
    tokenizer alone leaves a repo in the cache."""
    shutil.copytree(model_dir, to, ignore=shutil.ignore_patterns("*.safetensors"))
    return to


def test_a_partly_cached_repo_offline_says_what_is_missing(hf_home, model_dir, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = hub_cache(hf_home, REPO_ID, partial_copy(model_dir, hf_home.parent / "partial"))
    said = rf"{REPO_ID} is only partly in the Hugging Face cache \(.*: its weights"
    with pytest.raises(ModelNotFound, match=said) as err:
        resolve(REPO_ID)
    assert f"hf download {REPO_ID}" in str(err.value)
    # Sharded, one shard absent.
    shards = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    index = {"weight_map": {"a": shards[0], "b": shards[1]}}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    (snapshot / shards[0]).write_bytes(b"")
    with pytest.raises(ModelNotFound, match=f"1 of its 2 weight files, {shards[1]} first"):
        resolve(REPO_ID)


def test_a_partly_cached_repo_is_downloaded_whole(spawn, model_dir, fake_hub, hf_home):
    hub_cache(hf_home, REPO_ID, partial_copy(model_dir, hf_home.parent / "partial"))
    fake_hub(model_dir)
    p = spawn("--model", REPO_ID)
    p.wait_serving()
    assert len(generate(p.stub, prompt(8), max_tokens=2).tokens) == 2
    assert f"downloading {REPO_ID} from the Hugging Face Hub" in p.log.read_text()


@pytest.mark.parametrize("written", ["{name}", "./{name}", "."])
def test_a_relative_directory_is_named_in_full(written, model_dir, monkeypatch):
    # The log and GetServerInfo name the directory; relative, it says nothing
    # to a reader who does not know the worker's cwd (and "." has no name).
    monkeypatch.chdir(model_dir if written == "." else model_dir.parent)
    source = resolve(written.format(name=model_dir.name))
    assert source.path == model_dir.absolute()
    assert source.served_name is None
