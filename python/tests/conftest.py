import subprocess
import uuid

import pytest

import servers

BACKENDS = ["memory", "redis", "etcd", "postgres"]


@pytest.fixture(scope="session")
def redis_server():
    server = servers.start_redis()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def etcd_server():
    server = servers.start_etcd()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server():
    server = servers.start_postgres()
    yield server
    server.stop()


class Backend:
    """One backend under test: a URL with a namespace of its own (nothing
    outside it is touched), and a way to delete a lock behind its holder."""

    def __init__(self, name, server):
        self.name = name
        self.server = server
        self.namespace = "py_" + uuid.uuid4().hex[:12]
        if server is None:
            self.url = f"memory://{self.namespace}"
        else:
            self.url = f"{server.url}?namespace={self.namespace}"

    def delete_lock(self, key):
        """Deletes `key`'s lock on the server, as an operator (or a bug)
        might; the holder's next renewal is refused."""
        if self.name == "redis":
            import redis

            client = redis.Redis(host=servers.HOST, port=self.server.port)
            assert client.delete(f"{self.namespace}:{{{key}}}:lock") == 1
            client.close()
        elif self.name == "etcd":
            etcdctl = servers.binary("etcdctl")
            out = subprocess.run(
                [etcdctl, f"--endpoints={servers.HOST}:{self.server.port}", "del", "--prefix",
                 f"{self.namespace}/lock/{key}"],
                check=True, capture_output=True, env={"ETCDCTL_API": "3"},
            ).stdout
            assert int(out.split()[0]) >= 1, out
        elif self.name == "postgres":
            out = subprocess.run(
                self.server.psql + ["-c", f"DELETE FROM distlock_locks WHERE namespace = '{self.namespace}'"
                                    f" AND key = '{key}' RETURNING key"],
                check=True, capture_output=True,
            ).stdout
            assert out.strip() == key.encode(), out
        else:
            raise AssertionError(f"cannot delete behind a {self.name} lock")


@pytest.fixture(params=BACKENDS)
def backend(request):
    server = None if request.param == "memory" else request.getfixturevalue(f"{request.param}_server")
    return Backend(request.param, server)


@pytest.fixture(params=["redis", "etcd", "postgres"])
def server_backend(request):
    return Backend(request.param, request.getfixturevalue(f"{request.param}_server"))
