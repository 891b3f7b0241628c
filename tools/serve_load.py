#!/usr/bin/env python3
"""A bounded loopback load test of lfserve (CPU backend, tiny model), standard library only.

    python3 tools/serve_load.py --lfserve build/lfserve [--clients 256] [--requests 3000]
    python3 tools/serve_load.py --lfserve build/lfserve --clients 300 --requests 300 --pools 4 \
        --timeout 2 --max-tokens 400     # most requests queue far longer than --timeout

Starts a server on a tiny random model with a tokenizer, computes each prompt's greedy reference
(whole, non-streamed) first, then runs --clients concurrent streaming clients through
--requests requests. Passes when every request succeeds (zero errors), every stream is whole
(ends with a finish_reason and [DONE], carries exactly max_tokens token ids and the same ids
and text as the reference: greedy output does not depend on the batch), and afterwards
/metrics shows no pool in use, nothing queued and nothing in flight. Every fourth request also
carries a stop string cut from the middle of its reference text: it must end exactly before it
with finish_reason "stop" (the request is cancelled at the match, its pool returned at once).
Every other stream asks for stream_options.include_usage: then exactly one chunk, the last
(`choices: []`), carries usage; otherwise none does. /metrics outcomes must grow by exactly what
the clients saw (length and stop), with no error or disconnect. The longest wait in the queue
is printed: with few --pools, a short --timeout and long outputs, queued streams must still
come back whole (--timeout counts the client's idleness only, never the queue).
"""
import argparse
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "server"))
from serverlib import Server, make_tiny_chat_model, wait_idle  # noqa: E402
from loadlib import reference, run_all, stream_text, verdict  # noqa: E402

PROMPTS = ["Once upon a time", "The quick brown fox", "def main():\n    return 0",
           "Zürich ☃ emoji 🎉 test", "1 2 3 4 5 6 7 8", "   spaces   and\ttabs",
           "Hello, world!", "<think>why?</think>"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfserve", required=True)
    ap.add_argument("--model", help="model dir with a tokenizer (default: a generated tiny one)")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--pools", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=30, help="the server's --timeout (seconds)")
    ap.add_argument("--queue-timeout", type=int, default=None,
                    help="the server's --queue-timeout (seconds; 0: wait for a pool however "
                    "long; default: the server's)")
    ap.add_argument("--budget", type=int, default=64)
    a = ap.parse_args()
    model = a.model or make_tiny_chat_model(os.path.join(tempfile.mkdtemp(prefix="lfload-"), "tiny"))
    s = Server(a.lfserve, model, "--pools", str(a.pools), "--max-queue", str(a.clients * 2),
               "--budget", str(a.budget), "--threads", str(a.threads), "--max-connections",
               str(a.clients * 2 + 64), "--timeout", str(a.timeout),
               *(["--queue-timeout", str(a.queue_timeout)] if a.queue_timeout is not None else []))
    seen = {"length": 0, "stop": 0}
    waits = []  # seconds from sending a request to its first chunk
    errors, lock = [], threading.Lock()
    try:
        refs = []
        for i, p in enumerate(PROMPTS):
            chat, _, body, ids, text, stop = reference(s, i, p, a.max_tokens, 600)
            refs.append((chat, body, ids, text))
            # The same request with the stop string from the middle of its text.
            if stop:
                cut = text[:text.find(stop)]
                refs.append((chat, dict(body, stop=[stop]), None, cut))

        counter = iter(range(a.requests))
        base = s.metrics()

        def client():
            while True:
                with lock:
                    k = next(counter, None)
                if k is None:
                    return
                plain = [r for r in refs if r[2] is not None]
                stops = [r for r in refs if r[2] is None]
                chat, body, ids_ref, text_ref = (stops[(k // 4) % len(stops)] if k % 4 == 3 and stops
                                                 else plain[k % len(plain)])
                usage = (k // 4) % 2 == 0
                b = dict(body, stream=True)
                if usage:
                    b["stream_options"] = {"include_usage": True}
                try:
                    t_sent = time.time()
                    st, chunks, done = s.stream("/v1/chat/completions" if chat else "/v1/completions",
                                                b, timeout=600, first=lambda: waits.append(time.time() - t_sent))
                    assert st == 200, (st, chunks)
                    assert done, "no [DONE] (%d chunks)" % len(chunks)
                    n_usage = sum("usage" in c for c in chunks)
                    if usage:
                        assert n_usage == 1 and chunks[-1]["choices"] == [], "usage not once at the end"
                        u = chunks.pop()["usage"]
                        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u
                        if ids_ref is not None:
                            assert u["completion_tokens"] == a.max_tokens, u
                    else:
                        assert n_usage == 0, "usage without include_usage"
                    assert chunks, "no chunk"
                    fin = chunks[-1]["choices"][0]
                    assert fin["finish_reason"] == ("stop" if ids_ref is None else "length"), fin
                    ids, text = stream_text(chunks, chat)
                    assert text == text_ref, (text, text_ref)
                    if ids_ref is not None:
                        assert ids == ids_ref, (ids, ids_ref)
                    with lock:
                        seen[fin["finish_reason"]] += 1
                except Exception as e:  # noqa: BLE001
                    with lock:
                        errors.append("request %d: %r" % (k, e))

        t0 = time.time()
        th = [threading.Thread(target=client) for _ in range(a.clients)]
        run_all(th)
        dt = time.time() - t0
        m = wait_idle(s, 30)
        out = {k: int(m['lfserve_requests_total{outcome="%s"}' % k] -
                      base['lfserve_requests_total{outcome="%s"}' % k])
               for k in ("stop", "length", "error", "disconnected", "rejected", "invalid")}
        print("load: %d requests, %d concurrent streaming clients, %d pools, --timeout %d s, "
              "%d tokens each; %.1f s (%.0f req/s), %d errors; longest wait for a first chunk "
              "%.1f s (%d of %d over the timeout); clients saw %s, /metrics outcomes %s; after: "
              "pools used %d of %d, queue %d, in flight %d, tokens %d" %
              (a.requests, a.clients, a.pools, a.timeout, a.max_tokens, dt, a.requests / dt,
               len(errors), max(waits or [0]), sum(w > a.timeout for w in waits), len(waits),
               seen, out, m["lfserve_pools_used"], m["lfserve_pools_total"],
               m["lfserve_queue_length"], m["lfserve_requests_in_flight"],
               m["lfserve_tokens_generated_total"]))
        if out != dict(seen, error=0, disconnected=0, rejected=0, invalid=0):
            errors.append("/metrics outcomes %s differ from what the clients saw %s" % (out, seen))
        ok = not errors and m["lfserve_pools_used"] == 0
        ok = ok and m['lfserve_http_responses_total{code="500"}'] == 0
        ok = ok and m['lfserve_requests_total{outcome="error"}'] == 0
    finally:
        rc = s.stop()
    return verdict(s, rc, ok, errors)


if __name__ == "__main__":
    sys.exit(main())
