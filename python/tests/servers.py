"""Lock servers for the tests, started like the Rust harness
(conformance-tests/src/server): from the installed binaries, in a temporary
directory, on a free loopback port. A missing binary fails the test."""

import glob
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

HOST = "127.0.0.1"
_handed_out = set()


def free_port():
    """A free loopback port below the ephemeral range (as the Rust harness),
    never handed out twice in this process."""
    for _ in range(1000):
        port = random.randrange(20000, 32000)
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((HOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port in 20000-31999")


def binary(name, *search):
    for pattern in search:
        found = sorted(glob.glob(pattern))
        if found:
            return found[-1]
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; scripts/test installs it (apt-get)", pytrace=False)
    return path


def wait_until(ready, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except OSError as error:
            last = error
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not become ready in {timeout} s ({last})")


def accepts(port):
    with socket.create_connection((HOST, port), timeout=0.5):
        return True


class Server:
    """A server process in its own temporary directory."""

    #: The signal that stops the server at once (PostgreSQL's SIGTERM would
    #: wait for every client to disconnect).
    stop_signal = signal.SIGTERM

    def __init__(self, name):
        self.name = name
        self.dir = tempfile.mkdtemp(prefix=f"distlock-py-{name}-")
        self.process = None
        self.port = None
        self.url = None

    def spawn(self, command, **kwargs):
        log = open(os.path.join(self.dir, "server.log"), "wb")
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, **kwargs
        )

    def check_alive(self):
        if self.process.poll() is not None:
            with open(os.path.join(self.dir, "server.log"), "rb") as log:
                tail = log.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"{self.name} exited ({self.process.returncode}):\n{tail}")
        return True

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(self.stop_signal)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_redis():
    server = Server("redis")
    server.port = free_port()
    server.spawn(
        [
            binary("redis-server"),
            "--port", str(server.port),
            "--bind", HOST,
            "--save", "",
            "--appendonly", "no",
            "--dir", server.dir,
        ]
    )
    wait_until(lambda: server.check_alive() and accepts(server.port), "redis-server")
    server.url = f"redis://{HOST}:{server.port}"
    return server


def start_etcd():
    server = Server("etcd")
    server.port = free_port()
    peer = free_port()
    client_url = f"http://{HOST}:{server.port}"
    peer_url = f"http://{HOST}:{peer}"
    server.spawn(
        [
            binary("etcd"),
            "--name", "distlock",
            "--data-dir", os.path.join(server.dir, "data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"distlock={peer_url}",
            "--initial-cluster-state", "new",
            "--heartbeat-interval", "20",
            "--election-timeout", "100",
            "--logger", "zap",
            "--log-level", "warn",
        ]
    )

    def healthy():
        server.check_alive()
        with urllib.request.urlopen(f"{client_url}/health", timeout=2) as reply:
            return b'"health":"true"' in reply.read()

    wait_until(healthy, "etcd")
    server.url = f"etcd://{HOST}:{server.port}"
    return server


POSTGRES_BIN = "/usr/lib/postgresql/*/bin"


def _as_postgres_user():
    # PostgreSQL refuses to run as root; the Rust harness does the same.
    return {"user": "postgres", "group": "postgres"} if os.geteuid() == 0 else {}


def start_postgres():
    server = Server("postgres")
    server.stop_signal = signal.SIGINT
    initdb = binary("initdb", f"{POSTGRES_BIN}/initdb")
    postgres = binary("postgres", f"{POSTGRES_BIN}/postgres")
    as_user = _as_postgres_user()
    if as_user:
        shutil.chown(server.dir, "postgres", "postgres")
    data = os.path.join(server.dir, "data")
    subprocess.run(
        [initdb, "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"],
        check=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "LC_ALL": "C"},
        **as_user,
    )
    server.port = free_port()
    server.spawn(
        [
            postgres, "-D", data, "-p", str(server.port), "-h", HOST, "-k", server.dir,
            "-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=200",
        ],
        env={**os.environ, "LC_ALL": "C"},
        **as_user,
    )
    server.url = f"postgres://postgres@{HOST}:{server.port}/postgres"
    psql = binary("psql", f"{POSTGRES_BIN}/psql")
    server.psql = [psql, "-h", HOST, "-p", str(server.port), "-U", "postgres", "-d", "postgres", "-qAt"]

    def ready():
        server.check_alive()
        return subprocess.run(server.psql + ["-c", "select 1"], capture_output=True).returncode == 0

    wait_until(ready, "postgres")
    return server
