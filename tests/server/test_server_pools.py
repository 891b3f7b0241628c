#!/usr/bin/env python3
"""lfserve sizes its KV pools from memory unless --pools is given.

    python3 tests/server/test_server_pools.py --lfserve build/lfserve

The memory figure is injected with LF_MEM_AVAILABLE_BYTES (base/tuning.c: the cpu backend takes
it instead of MemAvailable), so each count is known in advance: floor(M x fraction / pool bytes)
(the pool's bytes from the start-up line), at most --max-pools; --pools wins; too little memory
for one pool fails at start with the figures. /metrics' lfserve_pools_total must agree.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Server, make_tiny_chat_model, run_suite  # noqa: E402

LINE = re.compile(r"lfserve: pools: (\d+) of [\d.]+ MiB \((\d+) bytes\) each \(budget (\d+) slots")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfserve", required=True)
    a = ap.parse_args()
    model = make_tiny_chat_model(os.path.join(tempfile.mkdtemp(prefix="lfpools-"), "tiny"))
    base = ["--threads", "1", "--budget", "256"]

    def start(servers, mem, *args):
        env = dict(os.environ, LF_MEM_AVAILABLE_BYTES=str(mem))
        s = Server(a.lfserve, model, *(base + list(args)), env=env)
        servers.append(s)
        log = s.read_log()
        m = LINE.search(log)
        assert m, log
        n, pool = int(m.group(1)), int(m.group(2))
        assert int(m.group(3)) == 256, log
        assert s.metrics()["lfserve_pools_total"] == n, (n, s.metrics()["lfserve_pools_total"])
        assert s.stop() == 0
        return n, pool, log

    def body(servers):
        _, pool, _ = start(servers, 1 << 30, "--pools", "1")
        assert pool > 0
        m = int(pool * 10.5 / 0.5)  # 10.5 pools at the default fraction 0.5
        n, _, log = start(servers, m)
        assert n == 10 and "MemAvailable x 0.5" in log, (n, log)
        n, _, _ = start(servers, m, "--kv-memory-fraction", "0.25")
        assert n == 5, n
        n, _, log = start(servers, m, "--max-pools", "3")
        assert n == 3 and "capped by --max-pools" in log, (n, log)
        n, _, log = start(servers, m, "--pools", "2")
        assert n == 2 and "(--pools)" in log, (n, log)
        n, _, _ = start(servers, 10 ** 15)  # a huge machine: the default cap
        assert n == 256, n
        # a fraction of the memory too small for one pool: a clear error at start
        env = dict(os.environ, LF_MEM_AVAILABLE_BYTES=str(1 << 30))
        frac = "%.3g" % (pool / 2 / (1 << 30))
        r = subprocess.run([a.lfserve, "--model", model, "--backend", "cpu", "--port", "0",
                            "--kv-memory-fraction", frac] + base,
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode != 0 and "holds no KV pool" in r.stderr, (r.returncode, r.stderr)
        assert "--pools" in r.stderr or "number of pools" in r.stderr, r.stderr
        print("pools: %d bytes each; 10.5 pools of memory -> 10, x0.25 -> 5, cap 3, --pools 2, "
              "cap 256, under one -> refused" % pool)

    return run_suite(body)


if __name__ == "__main__":
    sys.exit(main())
