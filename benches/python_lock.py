"""The Python package beside redis-py, in one run.

    python benches/python_lock.py [--pairs 2000] [--json target/python-bench.json]

Run it with the Python that has `distlock` and `redis` installed
(scripts/test-python's venv: target/pyenv/bin/python). It starts its own
redis-server on a free loopback port pinned to CPU 1 (`taskset`) and pins
itself to CPU 0 before the first lock call, so the runtime threads of the
extension run there too. Then, for every pair, with a fresh key each time and
the variants in a new random order, it times one acquire + release of:

- redis-py's `Lock` (`SET NX PX`, then its compare-and-delete script),
- the raw commands with the same client (`SET NX PX` + a compare-and-delete
  script by `EVALSHA`),
- distlock, `with locker.lock(key, ttl=30): pass` on `redis://` (fencing
  token, background renewal and ownership-checked release included),
- the same block on `memory://`, and a `PING` (one round trip).

It prints p50 / p90 / p99 in microseconds and the ratio of each p50 to
redis-py's `Lock`, and writes them as JSON. A benchmark, not a test: it
asserts nothing about time.
"""

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HOST = "127.0.0.1"
SERVER_CPU = 1
CLIENT_CPU = 0

RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end"


def free_port():
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def start_redis(directory):
    port = free_port()
    command = [
        shutil.which("redis-server") or sys.exit("redis-server is not installed"),
        "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no", "--dir", directory,
    ]
    pinned = shutil.which("taskset") is not None and os.cpu_count() > SERVER_CPU
    if pinned:
        command = ["taskset", "-c", str(SERVER_CPU), *command]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((HOST, port), timeout=0.2).close()
            return process, port, pinned
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                sys.exit("redis-server did not start")
            time.sleep(0.05)


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000, help="timed rounds (each runs every variant once)")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "..", "target", "python-bench.json"))
    options = parser.parse_args()

    directory = tempfile.mkdtemp(prefix="distlock-pybench-")
    server, port, server_pinned = start_redis(directory)
    try:
        # Before the extension starts its runtime: its threads inherit this.
        client_pinned = hasattr(os, "sched_setaffinity") and os.cpu_count() > SERVER_CPU
        if client_pinned:
            os.sched_setaffinity(0, {CLIENT_CPU})

        import redis

        import distlock

        r = redis.Redis(host=HOST, port=port)
        release = r.register_script(RELEASE)
        namespace = "bench_" + uuid.uuid4().hex[:8]
        on_redis = distlock.connect(f"redis://{HOST}:{port}?namespace={namespace}")
        in_memory = distlock.connect(f"memory://{namespace}")
        counter = iter(range(10**12))

        def fresh():
            return f"{namespace}-{next(counter)}"

        def redis_py_lock():
            lock = r.lock(fresh(), timeout=30)
            assert lock.acquire(blocking=False)
            lock.release()

        def raw_commands():
            key, token = fresh(), uuid.uuid4().hex
            assert r.set(key, token, nx=True, px=30000)
            assert release(keys=[key], args=[token]) == 1

        def distlock_redis():
            with on_redis.lock(fresh(), ttl=30):
                pass

        def distlock_memory():
            with in_memory.lock(fresh(), ttl=30):
                pass

        def ping():
            r.ping()

        variants = {
            "redis-py Lock": redis_py_lock,
            "raw SET NX PX + compare-and-delete": raw_commands,
            "distlock redis://": distlock_redis,
            "distlock memory://": distlock_memory,
            "PING (one round trip)": ping,
        }
        samples = {name: [] for name in variants}
        order = list(variants)
        clock = time.perf_counter_ns
        for round_number in range(options.warmup + options.pairs):
            random.shuffle(order)
            for name in order:
                run = variants[name]
                start = clock()
                run()
                elapsed = clock() - start
                if round_number >= options.warmup:
                    samples[name].append(elapsed / 1000)
        # The block also leaves nothing behind on the server.
        assert r.keys(f"{namespace}-*") == []
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(directory, ignore_errors=True)

    baseline = statistics.median(samples["redis-py Lock"])
    rows = []
    for name, values in samples.items():
        p50 = statistics.median(values)
        rows.append({
            "variant": name,
            "p50_us": round(p50, 1),
            "p90_us": round(percentile(values, 0.90), 1),
            "p99_us": round(percentile(values, 0.99), 1),
            "ratio_to_redis_py_lock": round(p50 / baseline, 3),
        })
    width = max(len(row["variant"]) for row in rows)
    print(f"{options.pairs} interleaved rounds, fresh key each; redis-server on CPU {SERVER_CPU}"
          f" ({'pinned' if server_pinned else 'NOT pinned'}), Python on CPU {CLIENT_CPU}"
          f" ({'pinned' if client_pinned else 'NOT pinned'})")
    print(f"{'variant':<{width}}  {'p50 µs':>8}  {'p90 µs':>8}  {'p99 µs':>8}  ratio")
    for row in rows:
        print(f"{row['variant']:<{width}}  {row['p50_us']:>8}  {row['p90_us']:>8}  {row['p99_us']:>8}"
              f"  {row['ratio_to_redis_py_lock']:.2f}x")
    report = {
        "pairs": options.pairs,
        "server_pinned_cpu": SERVER_CPU if server_pinned else None,
        "client_pinned_cpu": CLIENT_CPU if client_pinned else None,
        "python": sys.version.split()[0],
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(options.json)), exist_ok=True)
    with open(options.json, "w") as out:
        json.dump(report, out, indent=2)
        out.write("\n")


if __name__ == "__main__":
    main()
