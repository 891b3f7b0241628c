#!/usr/bin/env python3
"""lfserve under mpiexec -np 2: rank 0 serves HTTP, rank 1 follows.

    python3 tests/server/test_server_mpi.py --lfserve build/lfserve [--mpiexec mpiexec]
                                            [--backend cpu|cuda]

CI runs it on the CPU backend (MPI between the ranks); bench/run.sh tp runs it with
--backend cuda on two GPUs (NCCL between the ranks, one GPU per rank).

A single-rank server first gives greedy references (completions from text and from token ids,
one long enough to evict under a 64-slot budget, chat, streamed and whole, a stop string); the
two-rank server must give the same token ids and text, one request at a time and several at once,
and return every pool. Then the two ways to stop it:
  - SIGTERM to rank 0 (its pid is in the log): both ranks finalize MPI and exit 0, and so does
    mpiexec, within a few seconds;
  - SIGTERM to mpiexec with a request in flight: Open MPI's launcher turns it into a job abort
    (it signals every rank and kills them a second later); both ranks still shut down cleanly
    (each logs "stopped") and everything is gone within a few seconds.
Last, rank 1 killed (SIGKILL) with a stream in flight: the stream still ends with an error event
and [DONE], and the job is gone within seconds.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Server, make_tiny_chat_model, wait_idle  # noqa: E402

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"

REQUESTS = [
    (CMPL, {"prompt": "Hello world, tell me a story", "max_tokens": 16}),
    (CMPL, {"prompt": list(range(1, 40)), "max_tokens": 60}),  # 99 > 64 slots: evicts
    (CHAT, {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Zürich ☃ and 🎉?"}], "max_tokens": 12}),
    (CMPL, {"prompt": "def main():\n    return 0", "max_tokens": 10, "stream": True}),
    (CHAT, {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 10,
            "stream": True}),
]


def run(s, path, body):
    """(token ids, text, finish_reason) of one request, whole or streamed."""
    body = dict(body, ignore_eos=True, return_token_ids=True)
    chat = path == CHAT
    if body.get("stream"):
        st, chunks, done = s.stream(path, body)
        assert st == 200 and done, chunks
        ids, text = [], ""
        for c in chunks:
            ch = c["choices"][0]
            ids += ch.get("token_ids", [])
            text += ch["delta"].get("content", "") if chat else ch["text"]
        return ids, text, chunks[-1]["choices"][0]["finish_reason"]
    st, _, j, raw = s.post(path, body)
    assert st == 200, raw
    ch = j["choices"][0]
    return ch["token_ids"], ch["message"]["content"] if chat else ch["text"], ch["finish_reason"]


def with_stop(ref):
    """A stop-string request cut from the first reference (a span inside its text)."""
    text = ref[0][1]
    return (CMPL, dict(REQUESTS[0][1], stop=[text[len(text) // 2:len(text) // 2 + 3]]))


def rank0_pid(s):
    m = re.search(r"pid (\d+), 2 ranks", s.read_log())
    assert m, s.read_log()
    return int(m.group(1))


def pids_of(binary, port):
    """Processes running `binary ... --port PORT` (the ranks of one job)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % d, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if (argv and os.path.basename(argv[0]) == os.path.basename(binary).encode() and
                b"--port" in argv and argv[argv.index(b"--port") + 1:][:1] == [str(port).encode()]):
            out.append(int(d))
    return out


def wait_exit(proc, seconds):
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfserve", required=True)
    ap.add_argument("--mpiexec", default=shutil.which("mpiexec") or "mpiexec")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    a = ap.parse_args()
    env = os.environ.copy()
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1")
    launcher = [a.mpiexec, "-np", "2", "--oversubscribe"]
    if a.backend == "cuda":
        launcher = [a.mpiexec, "-np", "2", "-x", "NCCL_NVLS_ENABLE=0"]
    model = make_tiny_chat_model(os.path.join(tempfile.mkdtemp(prefix="lfmpi-"), "tinychat"))
    # head scope: the same evictions however the KV heads are split (layer scope is rank-local)
    args = ("--budget", "64", "--pools", "4", "--threads", "1", "--backend", a.backend,
            "--evict-scope", "head")
    servers, ok = [], True
    try:
        s = Server(a.lfserve, model, *args, env=env)
        servers.append(s)
        ref = [run(s, p, b) for p, b in REQUESTS]
        stop_req = with_stop(ref)
        ref.append(run(s, *stop_req))
        assert ref[-1][2] == "stop" and len(ref[-1][0]) < len(ref[0][0]), ref[-1]
        assert s.stop() == 0
        reqs = REQUESTS + [stop_req]

        t0 = time.time()
        s = Server(a.lfserve, model, *args, env=env, launcher=launcher)
        servers.append(s)
        print("two ranks up in %.1f s" % (time.time() - t0))
        got = [run(s, p, b) for p, b in reqs]
        for k, (g, r) in enumerate(zip(got, ref)):
            assert g == r, "request %d: two ranks %r, one rank %r" % (k, g, r)
        # several at once: batched steps on both ranks, the same greedy tokens
        conc = [None] * len(reqs)

        def worker(k):
            try:
                conc[k] = run(s, *reqs[k])
            except Exception as e:  # noqa: BLE001
                conc[k] = e

        th = [threading.Thread(target=worker, args=(k,)) for k in range(len(reqs))]
        for t in th:
            t.start()
        for t in th:
            t.join(120)
        for k, (g, r) in enumerate(zip(conc, ref)):
            assert g == r, "concurrent request %d: two ranks %r, one rank %r" % (k, g, r)
        m = wait_idle(s)
        assert m["lfserve_pools_used"] == 0 and m["lfserve_pools_total"] == 4, m
        assert m['lfserve_requests_total{outcome="error"}'] == 0, m
        print("ok  %d requests, alone and concurrent, equal to one rank" % (2 * len(reqs)))

        # SIGTERM to rank 0: a clean stop of both ranks and of mpiexec.
        t0 = time.time()
        os.kill(rank0_pid(s), signal.SIGTERM)
        rc = wait_exit(s.proc, 15)
        dt = time.time() - t0
        log = s.read_log()
        assert rc == 0, "mpiexec: %s after %.1f s\n%s" % (rc, dt, log)
        assert "rank 0 of 2: stopped" in log and "rank 1 of 2: stopped" in log, log
        assert dt < 5, dt
        print("ok  SIGTERM to rank 0: both ranks exited 0 in %.2f s" % dt)

        # SIGTERM to mpiexec, a request in flight: the launcher ends the job; both ranks still
        # shut down (requests cancelled, engine freed) and nothing is left running.
        s = Server(a.lfserve, model, *args, env=env, launcher=launcher)
        servers.append(s)
        c = s.conn()
        c.request("POST", CMPL, body='{"prompt": [1, 2, 3], "max_tokens": 900, "ignore_eos": true, '
                                     '"stream": true}', headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
        t0 = time.time()
        s.proc.send_signal(signal.SIGTERM)
        rc = wait_exit(s.proc, 15)
        dt = time.time() - t0
        c.close()
        log = s.read_log()
        assert rc is not None, "mpiexec still running after 15 s\n" + log
        assert "rank 0 of 2: stopped" in log and "rank 1 of 2: stopped" in log, log
        assert dt < 5, dt
        print("ok  SIGTERM to mpiexec: both ranks stopped, job gone in %.2f s (mpiexec exit %d)"
              % (dt, rc))
        # A follower killed mid-stream: the launcher ends the job, and rank 0 still ends its
        # streams properly (an error event, then [DONE]) rather than cutting them.
        s = Server(a.lfserve, model, *args, env=env, launcher=launcher)
        servers.append(s)
        r0 = rank0_pid(s)
        followers = [p for p in pids_of(a.lfserve, s.port) if p != r0]
        assert len(followers) == 1, followers
        c = s.conn(30)
        c.request("POST", CMPL, body='{"prompt": [1, 2, 3], "max_tokens": 900, "ignore_eos": true, '
                                     '"stream": true}', headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
        t0 = time.time()
        os.kill(followers[0], signal.SIGKILL)
        lines = []
        while True:
            line = r.readline()
            if not line:
                break
            if line.strip():
                lines.append(line.strip())
        c.close()
        rc = wait_exit(s.proc, 15)
        dt = time.time() - t0
        log = s.read_log()
        assert lines and lines[-1] == b"data: [DONE]", (lines[-3:], log[-3000:])
        assert b'"error"' in lines[-2], (lines[-3:], log[-3000:])
        assert rc is not None, "mpiexec still running after 15 s\n" + log
        print("ok  rank 1 killed mid-stream: the stream ended with an error event and [DONE] "
              "after %.2f s; job gone (mpiexec exit %d)" % (dt, rc))
    except Exception:
        ok = False
        traceback.print_exc()
        for s in servers:
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
                wait_exit(s.proc, 10)
            print("---- server log ----\n" + s.read_log()[-6000:])
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait()
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
