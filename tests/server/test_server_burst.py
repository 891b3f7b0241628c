#!/usr/bin/env python3
"""No connection left unanswered: N streaming requests opened at the same instant against few
pools and a short --timeout.

    python3 tests/server/test_server_burst.py --lfserve build/lfserve [--model PATH] [-n 300]

Every socket is connected (non-blocking) before any request is written; then all N requests go
out in one burst and every response is read concurrently (one selector, no threads). Passes
when every connection gets an HTTP status: 200 (a whole stream: [DONE], the finish_reason) or
503 with Retry-After (the server could not serve it in time); none is closed without a status.
/metrics must account for all of them: the completions' outcomes plus the refusals (by reason)
add up to N, and the server log says it refused them. The default model is the generated tiny
one (seconds); --model SmolLM2's GGUF reproduces issue 38 on two cores.
"""
import argparse
import json
import os
import selectors
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Server, make_tiny_chat_model, run_suite, wait_idle  # noqa: E402


def burst(port, n, body, deadline_s):
    """Opens n sockets, connects them all, then sends body on each; returns, per socket, the
    raw bytes it received before the server closed it (or deadline_s passed)."""
    req = ("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
           "application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
           ).encode() + body
    socks = []
    t_conn = time.time()
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    # Every connection established before any request is sent.
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        sel.register(s, selectors.EVENT_WRITE, i)
    pending, t_end = set(range(n)), time.time() + 30
    while pending and time.time() < t_end:
        for key, _ in sel.select(1.0):
            i = key.data
            err = socks[i].getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            assert err == 0, "connect %d: %s" % (i, os.strerror(err))
            sel.unregister(socks[i])
            pending.discard(i)
    assert not pending, "%d connections never established" % len(pending)
    print("all %d connected in %.2f s" % (n, time.time() - t_conn))
    for s in socks:
        s.setblocking(True)
        s.sendall(req)
        s.setblocking(False)
    t_sent = time.time()
    got = [bytearray() for _ in range(n)]
    for i, s in enumerate(socks):
        sel.register(s, selectors.EVENT_READ, i)
    open_ = set(range(n))
    global closed_at
    closed_at = [None] * n
    while open_ and time.time() < t_sent + deadline_s:
        for key, _ in sel.select(1.0):
            i = key.data
            try:
                d = socks[i].recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                d = b""
            except BlockingIOError:
                continue
            if d:
                got[i] += d
            else:
                sel.unregister(socks[i])
                open_.discard(i)
                closed_at[i] = time.time() - t_sent
    for s in socks:
        s.close()
    return got, len(open_), time.time() - t_sent


def parse(raw):
    """(status or None, headers dict, body bytes) of one HTTP/1.1 response."""
    head, sep, rest = bytes(raw).partition(b"\r\n\r\n")
    if not sep or not head.startswith(b"HTTP/1."):
        return None, {}, b""
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    h = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(":")
        h[k.strip().lower()] = v.strip()
    if h.get("transfer-encoding", "").lower() == "chunked":
        out, p = bytearray(), rest
        while True:
            size_s, sep, p = p.partition(b"\r\n")
            if not sep:
                break
            size = int(size_s.split(b";")[0], 16)
            if size == 0:
                break
            out += p[:size]
            p = p[size + 2:]
        rest = bytes(out)
    return status, h, rest


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfserve", required=True)
    ap.add_argument("--model", help="default: a generated tiny chat model")
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--timeout", type=int, default=1, help="the server's --timeout")
    ap.add_argument("--queue-timeout", type=float, default=1, help="the server's --queue-timeout")
    ap.add_argument("--deadline", type=float, default=150, help="seconds for the whole burst")
    ap.add_argument("--threads", type=int, default=0, help="the server's --threads (0: all)")
    ap.add_argument("--max-connections", type=int, default=0,
                    help="the server's --max-connections (0: its default)")
    a = ap.parse_args()
    n = a.n

    def body(servers):
        model = a.model or make_tiny_chat_model(os.path.join(tempfile.mkdtemp(prefix="lfburst-"), "tiny"))
        args = ["--pools", "4", "--timeout", str(a.timeout), "--queue-timeout", str(a.queue_timeout),
                "--served-model-name", "m"]
        if a.threads:
            args += ["--threads", str(a.threads)]
        if a.max_connections:
            args += ["--max-connections", str(a.max_connections)]
        s = Server(a.lfserve, model, *args)
        servers.append(s)
        m0 = s.metrics()
        req = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Tell me a story."}],
                          "max_tokens": a.max_tokens, "stream": True, "ignore_eos": True}).encode()
        got, still_open, secs = burst(s.port, n, req, deadline_s=a.deadline)
        if still_open:
            st = [parse(r)[0] for r in got]
            raise AssertionError("%d connections still open after %.0f s (statuses seen: %s)" % (
                still_open, secs, {k: st.count(k) for k in set(st)}))
        by = {}
        lost = []
        for i, raw in enumerate(got):
            st, h, b = parse(raw)
            if st is None:
                lost.append(i)
                continue
            by[st] = by.get(st, 0) + 1
            if st == 200:
                text = b.decode()
                assert text.rstrip().endswith("data: [DONE]"), (i, text[-300:])
                assert '"finish_reason":"length"' in text, (i, text[-300:])
            elif st == 503:
                assert h.get("retry-after", "").isdigit(), (i, h)
                err = json.loads(b)["error"]
                assert err["type"] == "server_error" and err["code"], (i, err)
            else:
                raise AssertionError("connection %d: status %d: %r" % (i, st, bytes(raw[:400])))
        print("burst of %d: %s, %d closed without a status, %.1f s" % (n, by, len(lost), secs))
        sys.stdout.flush()
        if lost:
            print("closed without a status after (s):", ["%.2f" % closed_at[i] for i in lost[:30]])
        assert not lost, "%d of %d connections closed without a status: %s" % (len(lost), n, lost[:20])
        m = wait_idle(s)
        d = {k: m[k] - m0.get(k, 0) for k in m}
        outcomes = {k: v for k, v in d.items() if k.startswith("lfserve_requests_total") and v}
        refused = {k: v for k, v in d.items() if k.startswith("lfserve_refused_total") and v}
        print("metrics: outcomes %s, refused %s" % (outcomes, refused))
        # Every request is counted once: served (length) or refused (rejected, by reason).
        assert d['lfserve_requests_total{outcome="length"}'] == by.get(200, 0), outcomes
        assert d['lfserve_requests_total{outcome="rejected"}'] == by.get(503, 0), outcomes
        assert sum(outcomes.values()) == n, (outcomes, n)
        assert sum(refused.values()) == by.get(503, 0), (refused, by)
        assert d['lfserve_http_responses_total{code="503"}'] == by.get(503, 0), d
        # A client that connects and sends nothing gets 408 once --timeout has passed.
        sk = socket.create_connection(("127.0.0.1", s.port))
        sk.settimeout(30)
        t0 = time.time()
        got = sk.recv(200)
        sk.close()
        assert got.startswith(b"HTTP/1.1 408 "), got
        assert a.timeout <= time.time() - t0 < a.timeout + 5, time.time() - t0
        assert s.metrics()['lfserve_timeouts_total{state="idle"}'] >= 1
        log = s.read_log()
        if by.get(503):
            assert "refused" in log, log[-2000:]
        assert s.stop() == 0

    return run_suite(body)


if __name__ == "__main__":
    sys.exit(main())
