#!/usr/bin/env python3
"""lfserve's data-parallel replicas under mpiexec (--tp T of N ranks: N/T replicas).

    python3 tests/server/test_server_dp.py --lfserve build/lfserve [--mpiexec mpiexec]

On CPU ranks, against a single-rank server's greedy references (the requests of
test_server_mpi.py: text and token-id prompts, one that evicts under a 64-slot budget, chat,
streamed and whole, a stop string):
  - 4 ranks as 2 replicas x TP2 (the tiny model's 2 KV heads split): every response, one at a
    time and all at once (twice over), equals the single-rank one; both replicas serve
    (lfserve_replica_routed_total); /v1/models lists one model; /metrics sums the pools (8) and
    labels each replica's (4 each); everything returns idle;
  - 2 ranks as 2 replicas x TP1: the same at once; with one pool each held by a stream, a
    request queued on either replica gets 503 + Retry-After after --queue-timeout;
  - bad configurations are refused at start, naming the valid choices: 3 ranks with --tp 2
    (exit 2, said once), --tp 3 on a model with 4 query and 2 KV heads;
  - SIGTERM to rank 0: every rank stops, finalizes MPI and exits 0 within 5 s;
  - replica 1's lead rank killed (SIGKILL) with a stream in flight on each replica: the job
    ends (Open MPI's launcher ends every rank when one dies: the behaviour lfserve documents);
    rank 0 first ends replica 1's stream with an error event and [DONE], replica 0's as
    cancelled (finish_reason "abort") or with an error event, then [DONE]; the job is gone
    within 10 s.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import ROOT, Server, make_tiny_chat_model, run_suite, wait_idle  # noqa: E402
from test_server_mpi import CMPL, REQUESTS, pids_of, run, wait_exit, with_stop  # noqa: E402


def all_at_once(s, reqs):
    out = [None] * len(reqs)

    def worker(k):
        try:
            out[k] = run(s, *reqs[k])
        except Exception as e:  # noqa: BLE001
            out[k] = e

    th = [threading.Thread(target=worker, args=(k,)) for k in range(len(reqs))]
    for t in th:
        t.start()
    for t in th:
        t.join(120)
    return out


def routed(m, n):
    return [m['lfserve_replica_routed_total{replica="%d"}' % r] for r in range(n)]


def open_stream(s):
    c = s.conn(30)
    c.request("POST", CMPL, body='{"prompt": [1, 2, 3], "max_tokens": 60000, "ignore_eos": true, '
                                 '"stream": true}', headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    return c, r


def stop_rank0(s, n):
    """SIGTERM to rank 0: every rank must stop, finalize MPI and exit 0 within 5 s (mpiexec too).
    Returns the seconds it took."""
    r0 = int(s.read_log().split("; pid ")[1].split(",")[0])
    t0 = time.time()
    os.kill(r0, signal.SIGTERM)
    rc = wait_exit(s.proc, 15)
    dt = time.time() - t0
    log = s.read_log()
    assert rc == 0, "mpiexec: %s after %.1f s\n%s" % (rc, dt, log)
    for r in range(n):
        assert "rank %d of %d: stopped\n" % (r, n) in log, log
    assert dt < 5, dt
    return dt


def world_rank(pid):
    """A rank's OMPI_COMM_WORLD_RANK (from its environment), -1 when unknown."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                    return int(kv.split(b"=", 1)[1])
    except OSError:
        pass
    return -1


def read_rest(r):
    lines = []
    while True:
        line = r.readline()
        if not line:
            return lines
        if line.strip():
            lines.append(line.strip())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfserve", required=True)
    ap.add_argument("--mpiexec", default=shutil.which("mpiexec") or "mpiexec")
    a = ap.parse_args()
    env = os.environ.copy()
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1")

    def launcher(n):
        return [a.mpiexec, "-np", str(n), "--oversubscribe"]

    # a long context: the streams cut by a dead rank cannot have finished on their own first
    model = make_tiny_chat_model(os.path.join(tempfile.mkdtemp(prefix="lfdp-"), "tinychat"),
                                 context=1 << 16)
    # head scope: the same evictions however the KV heads are split (layer scope is rank-local)
    args = ("--budget", "64", "--pools", "4", "--threads", "1", "--evict-scope", "head")

    def body(servers):
        s = Server(a.lfserve, model, *args, env=env)
        servers.append(s)
        ref = [run(s, p, b) for p, b in REQUESTS]
        stop_req = with_stop(ref)
        ref.append(run(s, *stop_req))
        assert ref[-1][2] == "stop", ref[-1]
        assert s.stop() == 0
        reqs = REQUESTS + [stop_req]

        # 2 replicas x TP2
        t0 = time.time()
        s = Server(a.lfserve, model, *args, "--tp", "2", env=env, launcher=launcher(4))
        servers.append(s)
        log = s.read_log()
        assert "4 ranks (2 replicas x tp 2)" in log and "pools 4 + 4" in log, log
        print("4 ranks as 2 replicas x TP2 up in %.1f s" % (time.time() - t0))
        for k, (p, b) in enumerate(reqs):
            g = run(s, p, b)
            assert g == ref[k], "request %d: %r, one rank %r" % (k, g, ref[k])
        for rnd in range(2):
            got = all_at_once(s, reqs)
            for k, g in enumerate(got):
                assert g == ref[k], "round %d, request %d at once: %r, one rank %r" % (
                    rnd, k, g, ref[k])
        m = wait_idle(s)
        n = routed(m, 2)
        assert sum(n) == 3 * len(reqs) and min(n) > 0, n
        assert m["lfserve_pools_total"] == 8 and m["lfserve_pools_used"] == 0, m
        assert m['lfserve_replica_pools_total{replica="1"}'] == 4, m
        assert m['lfserve_requests_total{outcome="error"}'] == 0, m
        st, _, body = s.request("GET", "/v1/models")
        assert st == 200 and len(json.loads(body)["data"]) == 1, body
        print("ok  %d requests on 2 replicas x TP2 (routed %s), alone and at once, equal to one "
              "rank" % (sum(n), n))

        dt = stop_rank0(s, 4)
        print("ok  SIGTERM to rank 0: 4 ranks exited 0 in %.2f s" % dt)

        # 2 replicas x TP1
        s = Server(a.lfserve, model, *args, "--tp", "1", env=env, launcher=launcher(2))
        servers.append(s)
        got = all_at_once(s, reqs)
        for k, g in enumerate(got):
            assert g == ref[k], "TP1 request %d at once: %r, one rank %r" % (k, g, ref[k])
        n = routed(wait_idle(s), 2)
        assert min(n) > 0, n
        # bench/http_load.py (the DP benchmark client) against it: all complete, both
        # replicas serve, and its JSON says so
        js = os.path.join(tempfile.mkdtemp(prefix="lfdp-load-"), "load.json")
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "http_load.py"), "--url",
                            "http://127.0.0.1:%d" % s.port, "--requests", "8", "--prompt", "16",
                            "--output", "24", "--vocab", "1000", "--json", js],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        with open(js) as f:
            load = json.load(f)
        assert load["completed"] == 8 and load["failed"] == 0, load
        assert sum(load["routed"].values()) == 8 and min(load["routed"].values()) > 0, load
        assert load["output_tokens_per_s"] > 0 and load["tpot_p50_s"] > 0, load
        stop_rank0(s, 2)
        print("ok  2 replicas x TP1 (routed %s): equal to one rank; http_load.py: 8 of 8, "
              "routed %s" % (n, load["routed"]))

        # One pool each, both held by streams: a request queued on either replica gets 503 +
        # Retry-After after --queue-timeout (the second one waits on replica 1, told by its
        # admission notices).
        s = Server(a.lfserve, model, "--budget", "64", "--pools", "1", "--threads", "1",
                   "--queue-timeout", "1", "--tp", "1", env=env, launcher=launcher(2))
        servers.append(s)
        held = [open_stream(s), open_stream(s)]
        t0 = time.time()
        # at once (the second a moment later): the first queues on replica 0 (a tie goes to the
        # lower index), the second on replica 1, which then has more free pools
        queued = [None, None]

        def post(k):
            queued[k] = s.post(CMPL, {"prompt": [1, 2, 3], "max_tokens": 4})

        th = [threading.Thread(target=post, args=(k,)) for k in range(2)]
        th[0].start()
        time.sleep(0.2)
        th[1].start()
        for t in th:
            t.join(30)
        for st, hdr, _, raw in queued:
            assert st == 503 and hdr.get("retry-after"), (st, raw)
        dt = time.time() - t0
        m = s.metrics()
        assert routed(m, 2) == [2, 2], routed(m, 2)
        assert m['lfserve_refused_total{reason="queue_timeout"}'] == 2, m
        for c, _ in held:
            c.close()
        stop_rank0(s, 2)
        print("ok  a request queued on each replica: 503 + Retry-After after --queue-timeout 1 "
              "(%.2f s for both)" % dt)

        # Bad configurations: refused at start with the choices named.
        p = subprocess.run(launcher(3) + [a.lfserve, "--model", model, "--backend", "cpu",
                                          "--port", "0", "--tp", "2"] + list(args),
                           env=env, capture_output=True, text=True, timeout=60)
        out = p.stdout + p.stderr
        assert p.returncode != 0 and "--tp may be 1 or 3" in out, out
        assert out.count("do not split into groups") == 1, out
        p = subprocess.run(launcher(3) + [a.lfserve, "--model", model, "--backend", "cpu",
                                          "--port", "0", "--tp", "3"] + list(args),
                           env=env, capture_output=True, text=True, timeout=60)
        out = p.stdout + p.stderr
        assert p.returncode != 0 and "T=3" in out and "1, 2, 4" in out, out
        print("ok  3 ranks with --tp 2 and --tp 3 refused at start, the choices named")

        # A rank of replica 1 killed with a stream on each replica.
        s = Server(a.lfserve, model, *args, "--tp", "2", env=env, launcher=launcher(4))
        servers.append(s)
        r0 = int(s.read_log().split("; pid ")[1].split(",")[0])
        streams = [open_stream(s), open_stream(s)]
        m = s.metrics()
        assert routed(m, 2) == [1, 1], routed(m, 2)
        ranks = sorted(pids_of(a.lfserve, s.port))
        assert len(ranks) == 4 and r0 in ranks, ranks
        # world ranks 2 and 3 are replica 1: kill its lead rank
        lead1 = [pid for pid in ranks if world_rank(pid) == 2]
        assert len(lead1) == 1, [(pid, world_rank(pid)) for pid in ranks]
        t0 = time.time()
        os.kill(lead1[0], signal.SIGKILL)
        ends = []
        for c, r in streams:
            lines = read_rest(r)
            c.close()
            assert lines and lines[-1] == b"data: [DONE]", lines[-3:]
            ends.append(lines[-2])
        # replica 0's stream is cancelled as the server stops (finish_reason "abort", or an error
        # event if it stops first); replica 1's can only end with an error event
        assert b'"error"' in ends[0] or b'"finish_reason":"abort"' in ends[0], ends
        assert b'"error"' in ends[1], ends
        rc = wait_exit(s.proc, 10)
        dt = time.time() - t0
        assert rc is not None, "mpiexec still running after 10 s\n" + s.read_log()
        print("ok  replica 1's lead rank killed: its stream ended with an error event, replica "
              "0's with %s, both with [DONE]; the job was gone after %.2f s (mpiexec exit %d)"
              % ("an error event" if b'"error"' in ends[0] else "finish_reason abort", dt, rc))

    return run_suite(body)


if __name__ == "__main__":
    sys.exit(main())
