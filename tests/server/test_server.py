#!/usr/bin/env python3
"""Endpoint behaviour and error statuses of lfserve, over loopback, standard library only.

    python3 tests/server/test_server.py --lfserve build/lfserve

Two servers: a tiny random Llama with a byte-level BPE tokenizer and chat template (made by
tools/make_tiny_chat_model.py) and tests/data/hf_tiny/llama (no tokenizer) under the `full`
policy with one pool; then tests/data/hf_tiny/llama with the LoRA adapter tests/data/lora/llama
(--lora). Exits non-zero on the first failure; the server's log is printed then.
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import ROOT, Server, make_tiny_chat_model, run_suite, wait_idle  # noqa: E402

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


def err_of(st, j, status, code=None):
    assert st == status, "status %s, wanted %s: %s" % (st, status, j)
    e = j["error"]
    assert isinstance(e["message"], str) and e["message"], j
    assert isinstance(e["type"], str) and "code" in e, j
    if code:
        assert e["code"] == code, "code %s, wanted %s: %s" % (e["code"], code, j)


def stream_text(chunks, chat):
    out, ids = "", []
    for c in chunks[:-1]:
        ch = c["choices"][0]
        out += ch["delta"].get("content", "") if chat else ch["text"]
        ids += ch.get("token_ids", [])
    return out, ids


def tests_tokenizer_server(s):
    st, _, data = s.request("GET", "/health")
    assert st == 200 and json.loads(data)["status"] == "ok"
    st, _, data = s.request("GET", "/v1/models")
    m = json.loads(data)
    assert st == 200 and m["data"][0]["id"] == "tinychat", m

    # completions: whole, streamed, equal under greedy
    body = {"model": "tinychat", "prompt": "Hello world, tell me a story", "max_tokens": 12,
            "ignore_eos": True, "return_token_ids": True}
    st, _, j, _ = s.post(CMPL, body)
    assert st == 200, j
    ch = j["choices"][0]
    assert j["object"] == "text_completion" and ch["finish_reason"] == "length", j
    assert len(ch["token_ids"]) == 12 and j["usage"]["completion_tokens"] == 12, j
    assert j["usage"]["total_tokens"] == j["usage"]["prompt_tokens"] + 12
    st, chunks, done = s.stream(CMPL, dict(body, stream=True, stream_options={"include_usage": True}))
    assert st == 200 and done, chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    # usage once, in that last chunk only (as OpenAI sends it): summing it counts it once
    assert sum("usage" in c for c in chunks) == 1, chunks
    chunks = chunks[:-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text, ids = stream_text(chunks, False)
    text += chunks[-1]["choices"][0]["text"]
    assert ids == ch["token_ids"], (ids, ch["token_ids"])
    assert text == ch["text"], (text, ch["text"])

    # chat, whole and streamed
    cbody = {"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                       {"type": "text", "text": "there ☃"}]}],
             "max_completion_tokens": 10, "ignore_eos": True}
    st, _, j, _ = s.post(CHAT, cbody)
    assert st == 200 and j["object"] == "chat.completion", j
    msg = j["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    st, chunks, done = s.stream(CHAT, dict(cbody, stream=True))
    assert st == 200 and done
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text, _ = stream_text(chunks, True)
    text += chunks[-1]["choices"][0]["delta"].get("content", "")
    assert text == msg["content"], (text, msg["content"])
    # without stream_options.include_usage no chunk carries usage
    assert not any("usage" in c for c in chunks), chunks[-1]

    # sampling parameters and seeds: same seed, same text
    sb = dict(body, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    a = s.post(CMPL, sb)[2]["choices"][0]["token_ids"]
    b = s.post(CMPL, sb)[2]["choices"][0]["token_ids"]
    assert a == b

    # stops: a stop id ends before it; stop sequences of ids; a stop string is accepted
    gen = ch["token_ids"]
    k = next(i for i in range(2, len(gen)) if gen[i] not in gen[:i])
    for stop in ({"stop_token_ids": [gen[k]]}, {"stop": [gen[k]]}, {"stop": [[gen[k]]]}):
        st, _, j, _ = s.post(CMPL, dict(body, **stop))
        assert st == 200, j
        assert j["choices"][0]["finish_reason"] == "stop", (stop, j)
        assert j["choices"][0]["token_ids"] == gen[:k], (stop, j["choices"][0]["token_ids"], gen)
    st, _, j, _ = s.post(CMPL, dict(body, stop=["\n\n", "the"]))
    assert st == 200, j
    st, _, j, _ = s.post(CMPL, dict(body, stop="x"))
    assert st == 200, j

    # bad input
    bad = [
        (b"{not json", 400, "invalid_json"),
        (b"", 400, "invalid_json"),
        (b"[1,2]", 400, None),
        (b"\xff\xfe{}", 400, "invalid_json"),
        (b"{\"prompt\": \"a\xc3\"}", 400, "invalid_json"),
        (b"[" * 5000 + b"]" * 5000, 400, "invalid_json"),
    ]
    for raw, status, code in bad:
        st, _, data = s.request("POST", CMPL, raw)
        err_of(st, json.loads(data), status, code)
    cases = [
        ({"prompt": "hi", "model": "gpt-4"}, 404, "model_not_found"),
        ({"prompt": "hi", "model": 5}, 400, None),
        ({"prompt": "hi", "max_tokens": 0}, 400, None),
        ({"prompt": "hi", "max_tokens": -3}, 400, None),
        ({"prompt": "hi", "max_tokens": 10 ** 9}, 400, None),
        ({"prompt": "hi", "max_tokens": 1e300}, 400, None),
        ({"prompt": "hi", "max_tokens": "5"}, 400, "invalid_type"),
        ({"prompt": "hi", "max_tokens": 2.5}, 400, "invalid_type"),
        ({"prompt": "hi", "temperature": "hot"}, 400, "invalid_type"),
        ({"prompt": "hi", "temperature": -1}, 400, None),
        ({"prompt": "hi", "top_p": 0}, 400, None),
        ({"prompt": "hi", "top_p": 1.5}, 400, None),
        ({"prompt": "hi", "top_k": -5}, 400, None),
        ({"prompt": "hi", "stream": 1}, 400, "invalid_type"),
        ({"prompt": "hi", "n": 2}, 400, None),
        ({"prompt": "hi", "seed": 1.5}, 400, None),
        ({"prompt": "hi", "stop": 5.5}, 400, None),
        ({"prompt": "hi", "stop": [{}]}, 400, None),
        ({"prompt": "hi", "stop": ["a"] * 100}, 400, None),
        ({"prompt": "hi", "stop_token_ids": [-1]}, 400, None),
        ({"prompt": "hi", "logprobs": 6}, 400, None),
        ({"prompt": "hi", "tools": [{"type": "function"}]}, 400, "unsupported_parameter"),
        ({"prompt": "hi", "logit_bias": {"99999": 1}}, 400, None),
        ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, None),
        ({"prompt": "hi", "presence_penalty": 2.5}, 400, None),
        ({"prompt": "hi", "repetition_penalty": 0}, 400, None),
        ({"prompt": "hi", "response_format": {"type": "json_object"}}, 400, None),
        ({"prompt": ""}, 400, None),
        ({"prompt": []}, 400, None),
        ({"prompt": [[]]}, 400, None),
        ({"prompt": ["a", "b"]}, 400, None),
        ({"prompt": [1, 2, 99999]}, 400, "invalid_token_id"),
        ({"prompt": [1, -2]}, 400, "invalid_token_id"),
        ({"prompt": [1, 2.5]}, 400, None),
        ({"prompt": 5}, 400, "invalid_type"),
        ({"prompt": None}, 400, None),
        ({}, 400, "missing_required_parameter"),
        ({"prompt": [5] * 8200}, 400, "context_length_exceeded"),
        ({"prompt": [5] * 8150, "max_tokens": 100}, 400, "context_length_exceeded"),
    ]
    for body_, status, code in cases:
        st, _, j, raw = s.post(CMPL, body_)
        assert j is not None, raw
        err_of(st, j, status, code)
    chat_cases = [
        ({"messages": []}, 400, None),
        ({"messages": "hi"}, 400, "invalid_type"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ({"messages": [{"role": "user"}]}, 400, None),
        ({"messages": [{"role": "user", "content": 5}]}, 400, None),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
        ({"messages": [{"role": "user", "content": "a\u0000b"}]}, 400, None),
        ({"prompt": "x"}, 400, "missing_required_parameter"),
    ]
    for body_, status, code in chat_cases:
        st, _, j, _ = s.post(CHAT, body_)
        err_of(st, j, status, code)
    st, _, data = s.request("GET", CMPL)
    err_of(st, json.loads(data), 405)
    st, _, data = s.request("POST", "/v1/models", b"{}")
    err_of(st, json.loads(data), 405)
    st, _, data = s.request("GET", "/nope")
    err_of(st, json.loads(data), 404)
    # oversized bodies: declared, and chunked without a length
    st, _, data = s.request("POST", CMPL, b"x" * 70000)
    err_of(st, json.loads(data), 413, "request_too_large")
    c = s.conn()
    c.putrequest("POST", CMPL)
    c.putheader("Transfer-Encoding", "chunked")
    c.endheaders()
    for _ in range(20):
        c.send(b"1000\r\n" + b"y" * 4096 + b"\r\n")
    c.send(b"0\r\n\r\n")
    r = c.getresponse()
    err_of(r.status, json.loads(r.read()), 413)
    c.close()

    # a slow client (half a body) gets 408 and is dropped after --timeout; the server stays up
    sk = socket.create_connection(("127.0.0.1", s.port))
    sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
    sk.settimeout(10)
    t0 = time.time()
    try:
        got = sk.recv(100)
    except (ConnectionResetError, socket.timeout):
        got = b""
    assert got.startswith(b"HTTP/1.1 408 ") and time.time() - t0 < 9, got
    sk.close()

    # four pools, a queue of two: the seventh concurrent request gets 503 with Retry-After
    # (--queue-timeout 0 here: queued streams get their headers at once)
    holders, ready = [], threading.Event()

    def hold():
        c = s.conn()
        c.request("POST", CMPL, body=json.dumps({"prompt": [1, 2], "max_tokens": 8000,
                                                 "ignore_eos": True, "stream": True}))
        r = c.getresponse()
        holders.append((c, r))
        ready.set()

    # One at a time: admission happens at the engine's next step, so requests arriving together
    # can find the queue full before the first of them takes a pool.
    for i in range(6):
        ready.clear()
        threading.Thread(target=hold, daemon=True).start()
        ready.wait(10)
        deadline = time.time() + 10
        while time.time() < deadline:
            m = s.metrics()
            if m["lfserve_running"] == min(i + 1, 4) and m["lfserve_queue_length"] == max(0, i - 3):
                break
            time.sleep(0.005)
    assert all(r.status == 200 for _, r in holders), [r.status for _, r in holders]
    st, h, j, _ = s.post(CMPL, {"prompt": [1, 2], "max_tokens": 2})
    err_of(st, j, 503, "queue_full")
    assert "retry-after" in h, h
    for c, r in holders:
        r.close()
        c.close()  # vanish: the requests are cancelled
    m = wait_idle(s)
    assert m['lfserve_requests_total{outcome="rejected"}'] >= 1
    assert m['lfserve_refused_total{reason="queue_full"}'] >= 1, m

    # a client that vanishes mid-stream gets its request cancelled and its pool back
    before = s.metrics()['lfserve_requests_total{outcome="disconnected"}']
    sk = socket.create_connection(("127.0.0.1", s.port))
    req = json.dumps({"prompt": [1, 2, 3], "max_tokens": 8000, "ignore_eos": True,
                      "stream": True}).encode()
    sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(req) + req)
    got = b""
    while got.count(b"data: ") < 3:
        got += sk.recv(4096)
    sk.close()
    deadline = time.time() + 5
    while s.metrics()["lfserve_running"] > 0 and time.time() < deadline:
        time.sleep(0.01)
    # and one that vanishes while a whole (non-streamed) completion is generated
    sk = socket.create_connection(("127.0.0.1", s.port))
    req = json.dumps({"prompt": [1, 2, 3], "max_tokens": 8000, "ignore_eos": True}).encode()
    sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(req)
               + req)
    deadline = time.time() + 5
    while s.metrics()["lfserve_running"] < 1 and time.time() < deadline:
        time.sleep(0.01)
    sk.close()
    m = wait_idle(s, 20)
    assert m['lfserve_requests_total{outcome="disconnected"}'] >= before + 2, m
    assert m["lfserve_pools_used"] == 0
    assert m["lfserve_ttft_seconds_count"] > 0 and 'lfserve_ttft_seconds_bucket{le="+Inf"}' in m
    assert m["lfserve_tpot_seconds_count"] > 0


def tests_connection_limit(s, max_conn=8, extra=20):
    """More silent sockets than --max-connections: the oldest idle ones are shed (with a 503),
    so /health, /metrics and completions still get through at once."""
    socks = []
    try:
        for _ in range(max_conn + extra):
            k = socket.create_connection(("127.0.0.1", s.port), timeout=5)
            socks.append(k)
        time.sleep(0.2)
        t0 = time.time()
        st, _, data = s.request("GET", "/health", timeout=3)
        dt = time.time() - t0
        assert st == 200 and dt < 2, (st, dt, data)
        st, _, _ = s.request("GET", "/metrics", timeout=3)
        assert st == 200
        st, _, j, _ = s.post(CMPL, {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}, timeout=10)
        assert st == 200 and j["usage"]["completion_tokens"] == 3, j
        # the oldest silent sockets were shut down to make room, each with a 503 first (it had
        # not sent a request): a status, never a bare close
        shed = 0
        for k in socks[:extra]:
            k.settimeout(0.5)
            got = b""
            try:
                while True:
                    d = k.recv(4096)
                    if not d:
                        break
                    got += d
            except (socket.timeout, OSError):
                continue
            assert got.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in got, got
            shed += 1
        assert shed >= extra // 2, shed
        print("    %d silent sockets over a limit of %d: /health in %.3f s, %d oldest shed"
              % (max_conn + extra, max_conn, dt, shed))
    finally:
        for k in socks:
            k.close()


def tests_no_template(s_off, s_on):
    """A model without a chat template: chat is refused with a clear 400 unless
    --chat-template names one; start-up says which."""
    assert "chat: off (the model has no chat template" in s_off.read_log(), s_off.read_log()
    st, _, j, _ = s_off.post(CHAT, {"messages": [{"role": "user", "content": "x"}]})
    err_of(st, j, 400, "no_chat_template")
    assert "--chat-template" in j["error"]["message"], j
    st, _, j, _ = s_off.post(CMPL, {"prompt": "hi", "max_tokens": 2})
    assert st == 200, j
    assert "chat: chatml (--chat-template)" in s_on.read_log(), s_on.read_log()
    st, _, j, _ = s_on.post(CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                                   "ignore_eos": True})
    assert st == 200 and j["usage"]["completion_tokens"] == 3, j


def tests_token_server(s):
    st, _, j, _ = s.post(CMPL, {"prompt": "text"})
    err_of(st, j, 400, "no_tokenizer")
    st, _, j, _ = s.post(CHAT, {"messages": [{"role": "user", "content": "x"}]})
    err_of(st, j, 400, "no_chat_template")
    st, _, j, _ = s.post(CMPL, {"prompt": [1, 5, 9, 13], "max_tokens": 6, "ignore_eos": True})
    assert st == 200 and len(j["choices"][0]["token_ids"]) == 6, j
    # full policy, budget 32: prompt and output must fit the pool
    st, _, j, _ = s.post(CMPL, {"prompt": [5] * 40, "max_tokens": 1})
    err_of(st, j, 400, "context_length_exceeded")
    st, _, j, _ = s.post(CMPL, {"prompt": [5] * 20, "max_tokens": 20})
    err_of(st, j, 400, "context_length_exceeded")
    st, _, j, _ = s.post(CMPL, {"prompt": [5] * 20, "max_tokens": 13, "ignore_eos": True})
    assert st == 200 and j["usage"]["completion_tokens"] == 13, j



def lora_ref():
    with open(os.path.join(ROOT, "tests", "data", "lora", "llama", "reference.json")) as f:
        return json.load(f)


def tests_lora_server(s):
    """--lora: the completion is the greedy continuation of PEFT's merged model."""
    ref = lora_ref()
    st, _, j, _ = s.post(CMPL, {"prompt": ref["prompt"], "max_tokens": len(ref["greedy"]),
                                "temperature": 0, "ignore_eos": True})
    assert st == 200 and j["choices"][0]["token_ids"] == ref["greedy"], j
    assert "llama + LoRA adapter " in s.read_log(), s.read_log()


def tests_lora_refused(lfserve):
    """An adapter that does not fit the model: lfserve exits 1 at start-up naming the file."""
    p = subprocess.run([lfserve, "--model", os.path.join(ROOT, "tests", "data", "hf_tiny", "llama"),
                        "--lora", os.path.join(ROOT, "tests", "data", "lora", "qwen2"),
                        "--port", "0", "--backend", "cpu"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert p.returncode == 1 and "adapter_model.safetensors" in p.stdout, (p.returncode, p.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfserve", required=True)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="lfserve-test-")
    model = make_tiny_chat_model(os.path.join(tmp, "tinychat"), context=8192)

    def run(servers):
        for args, fn in (
            ((model, "--budget", "64", "--pools", "4", "--max-body", "65536", "--timeout", "2", "--max-queue", "2",
              "--queue-timeout", "0", "--threads", "1"), tests_tokenizer_server),
            ((os.path.join(ROOT, "tests", "data", "hf_tiny", "llama"), "--policy", "full",
              "--budget", "32", "--pools", "1", "--max-queue", "1", "--threads", "1"),
             tests_token_server),
            ((os.path.join(ROOT, "tests", "data", "hf_tiny", "llama"), "--lora",
              os.path.join(ROOT, "tests", "data", "lora", "llama"), "--threads", "1"),
             tests_lora_server),
        ):
            s = Server(a.lfserve, *args)
            servers.append(s)
            t0 = time.time()
            fn(s)
            print("ok  %s (%.1f s)" % (fn.__name__, time.time() - t0))
            rc = s.stop()
            if rc != 0:
                raise AssertionError("lfserve exited with %s:\n%s" % (rc, s.read_log()[-4000:]))
        tests_lora_refused(a.lfserve)
        print("ok  tests_lora_refused")
        s = Server(a.lfserve, model, "--max-connections", "8", "--timeout", "30", "--threads", "1")
        servers.append(s)
        tests_connection_limit(s)
        print("ok  tests_connection_limit")
        s.stop()
        # the same model without its chat template
        bare = os.path.join(tmp, "bare")
        shutil.copytree(model, bare)
        cfgp = os.path.join(bare, "tokenizer_config.json")
        with open(cfgp) as f:
            cfg = json.load(f)
        cfg.pop("chat_template", None)
        with open(cfgp, "w") as f:
            json.dump(cfg, f)
        s_off = Server(a.lfserve, bare, "--threads", "1")
        servers.append(s_off)
        s_on = Server(a.lfserve, bare, "--threads", "1", "--chat-template", "chatml")
        servers.append(s_on)
        tests_no_template(s_off, s_on)
        print("ok  tests_no_template")
        for x in (s_off, s_on):
            if x.stop() != 0:
                raise AssertionError("lfserve exited with an error:\n" + x.read_log()[-4000:])

    return run_suite(run)


if __name__ == "__main__":
    sys.exit(main())
