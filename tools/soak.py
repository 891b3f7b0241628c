#!/usr/bin/env python3
"""A long soak of lfserve (CPU backend, tiny model), standard library only.

    python3 tools/soak.py --lfserve build/lfserve [--minutes 10] [--clients 12] [--pools 4]

Mixed traffic for --minutes: streamed and whole completions and chats, streams the client drops
after a few chunks (cancelled), and requests with a stop string cut from the middle of their
reference text. Every completed request is checked against its greedy reference (computed
first, whole). The server's RSS and pools in use are sampled every few seconds. Passes when no
request failed, the pools in use return to 0 at the end, /metrics outcomes equal what the
clients saw, and the RSS at the end is within --rss-slack-mb of the RSS after the warm-up.
"""
import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "server"))
from serverlib import Server, make_tiny_chat_model, wait_idle  # noqa: E402
from loadlib import reference, run_all, stream_text, verdict  # noqa: E402

PROMPTS = ["Once upon a time", "The quick brown fox", "def main():\n    return 0",
           "Zürich ☃ emoji 🎉 test", "1 2 3 4 5 6 7 8", "Hello, world!"]
KINDS = ("stream", "whole", "cancel", "stop")


def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfserve", required=True)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--pools", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--timeout", type=int, default=2, help="the server's --timeout")
    ap.add_argument("--pause", type=float, default=0.02, help="seconds a client waits between requests")
    ap.add_argument("--rss-slack-mb", type=float, default=8)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    model = make_tiny_chat_model(os.path.join(tempfile.mkdtemp(prefix="lfsoak-"), "tiny"))
    s = Server(a.lfserve, model, "--pools", str(a.pools), "--max-queue", str(a.clients * 4),
               "--budget", "64", "--threads", "1", "--timeout", str(a.timeout))
    lock = threading.Lock()
    errors, counts = [], {k: 0 for k in KINDS}
    samples = []  # (t, rss kB, pools used, queue)
    ok = True
    try:
        refs = []
        for i, p in enumerate(PROMPTS):
            refs.append(reference(s, i, p, a.max_tokens, 120))
        base = s.metrics()
        end = time.time() + a.minutes * 60

        def client(seed):
            rng = random.Random(seed)
            while time.time() < end:
                kind = KINDS[rng.randrange(len(KINDS))]
                chat, path, body, ids_ref, text_ref, stop = refs[rng.randrange(len(refs))]
                if kind == "stop" and not stop:
                    kind = "stream"
                try:
                    if kind == "whole":
                        st, _, j, raw = s.post(path, body, timeout=300)
                        assert st == 200, raw
                        ch = j["choices"][0]
                        assert ch["token_ids"] == ids_ref and ch["finish_reason"] == "length", j
                        assert j["usage"]["completion_tokens"] == len(ids_ref), j
                    elif kind == "cancel":
                        c = s.conn(300)
                        c.request("POST", path, body=json.dumps(dict(body, stream=True)),
                                  headers={"Content-Type": "application/json"})
                        r = c.getresponse()
                        assert r.status == 200, r.status
                        for _ in range(rng.randrange(1, 6)):
                            r.readline()
                        c.sock.close()  # drop the stream mid-way: the server cancels it
                        c.close()
                    else:
                        b = dict(body, stream=True, stream_options={"include_usage": True})
                        if kind == "stop":
                            b["stop"] = [stop]
                        st, chunks, done = s.stream(path, b, timeout=300)
                        assert st == 200 and done, (st, chunks[-1:])
                        assert chunks[-1]["choices"] == [], chunks[-1]
                        assert sum("usage" in c for c in chunks) == 1, "usage not once"
                        ids, text = stream_text(chunks, chat)
                        fin = chunks[-2]["choices"][0]["finish_reason"]
                        if kind == "stop":
                            assert fin == "stop" and text == text_ref[:text_ref.find(stop)], (text, stop)
                        else:
                            assert fin == "length" and ids == ids_ref and text == text_ref, (ids, ids_ref)
                            assert chunks[-1]["usage"]["completion_tokens"] == len(ids_ref)
                    with lock:
                        counts[kind] += 1
                except Exception as e:  # noqa: BLE001
                    with lock:
                        errors.append("%s: %r" % (kind, e))
                time.sleep(a.pause)

        def sampler():
            while time.time() < end:
                m = s.metrics()
                samples.append((time.time(), rss_kb(s.proc.pid), int(m["lfserve_pools_used"]),
                                int(m["lfserve_queue_length"])))
                time.sleep(5)

        t0 = time.time()
        th = [threading.Thread(target=client, args=(a.seed * 1000 + i,)) for i in range(a.clients)]
        th.append(threading.Thread(target=sampler))
        run_all(th)
        dt = time.time() - t0
        m = wait_idle(s, 60)
        rss_end = rss_kb(s.proc.pid)
        d = {k: m['lfserve_requests_total{outcome="%s"}' % k] -
             base['lfserve_requests_total{outcome="%s"}' % k]
             for k in ("stop", "length", "error", "disconnected", "rejected", "invalid")}
        warm = [x for x in samples if x[0] - t0 >= 60] or samples
        rss_warm = warm[0][1]
        print("soak: %.1f min, %d clients, pools %d, --timeout %d s; requests %s (total %d), "
              "errors %d" % (dt / 60, a.clients, a.pools, a.timeout, counts, sum(counts.values()),
                             len(errors)))
        print("metrics outcomes during the soak: %s" % {k: int(v) for k, v in d.items()})
        print("RSS: start %d kB, after 1 min %d kB, max %d kB, end %d kB; pools used max %d, "
              "at the end %d; queue max %d" % (samples[0][1], rss_warm, max(x[1] for x in samples),
                                               rss_end, max(x[2] for x in samples),
                                               m["lfserve_pools_used"], max(x[3] for x in samples)))
        ok = not errors and m["lfserve_pools_used"] == 0
        ok = ok and d["error"] == 0 and d["rejected"] == 0 and d["invalid"] == 0
        # Cancelled streams may have finished before the server saw the client go.
        ok = ok and d["stop"] == counts["stop"] and d["disconnected"] <= counts["cancel"]
        ok = ok and d["length"] == counts["stream"] + counts["whole"] + counts["cancel"] - d["disconnected"]
        ok = ok and rss_end - rss_warm <= a.rss_slack_mb * 1024
    finally:
        rc = s.stop()
    return verdict(s, rc, ok, errors)


if __name__ == "__main__":
    sys.exit(main())
