#!/usr/bin/env python3
"""API keys and the listening address of lfserve.

    python3 tests/server/test_server_auth.py --lfserve build/lfserve

- LFSERVE_API_KEY: /v1/* needs "Authorization: Bearer <key>" (401, an OpenAI-style error body
  and WWW-Authenticate: Bearer otherwise; a wrong, shorter, longer or differently cased key is
  refused); /health and /metrics stay open.
- --api-key-file with --auth-metrics: the file's first line is the key (it wins over the
  environment), and /health and /metrics need it too.
- --api-key on the command line is refused (argv is visible to every user); an empty key file
  is refused.
- Without --host the server listens on 127.0.0.1 only (the kernel's socket table says so);
  --host 0.0.0.0 listens on every interface and warns when no key is set.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Server, free_port, make_tiny_chat_model, run_suite  # noqa: E402

KEY = "sk-test-0123456789abcdef"
CMPL = "/v1/completions"


def check_401(st, h, data, what):
    assert st == 401, "%s: status %s: %r" % (what, st, data[:200])
    assert h.get("www-authenticate") == "Bearer", (what, h)
    e = json.loads(data)["error"]
    assert e["code"] == "invalid_api_key" and e["type"] == "invalid_request_error", (what, e)
    assert "Authorization: Bearer" in e["message"], (what, e)


def listen_addrs(port):
    """The local addresses with a socket listening on port (IPv4, from /proc/net/tcp)."""
    out = []
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split()
            addr, p = parts[1].split(":")
            if parts[3] == "0A" and int(p, 16) == port:  # 0A: LISTEN
                out.append(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return out


def start_raw(binary, model, *args, env=None):
    """lfserve with exactly these options (no --host): returns (proc, port, log path) once it
    prints its address."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="lfserve-", suffix=".log", delete=False)
    p = subprocess.Popen([binary, "--model", model, "--port", str(port), "--backend", "cpu",
                          "--threads", "1"] + list(args), stdout=log, stderr=subprocess.STDOUT,
                         env=env or os.environ.copy())
    deadline = time.time() + 60
    while time.time() < deadline:
        text = open(log.name, errors="replace").read()
        if "serving '" in text:
            return p, port, log.name
        if p.poll() is not None:
            raise AssertionError("lfserve exited %s: %s" % (p.returncode, text))
        time.sleep(0.05)
    p.kill()
    raise AssertionError("lfserve did not start")


def stop_raw(p):
    p.terminate()
    assert p.wait(60) == 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfserve", required=True)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="lfauth-")
    model = make_tiny_chat_model(os.path.join(tmp, "tiny"))

    def body(servers):
        # --- the key from the environment; /health and /metrics open -------------------------
        env = dict(os.environ, LFSERVE_API_KEY=KEY)
        s = Server(a.lfserve, model, "--pools", "1", "--threads", "1", env=env)
        servers.append(s)
        assert "auth: an API key (LFSERVE_API_KEY) on /v1/*" in s.read_log(), s.read_log()
        ok = {"Authorization": "Bearer " + KEY}
        req = {"prompt": "Once upon", "max_tokens": 2}
        for path, method, b in (("/v1/models", "GET", None), (CMPL, "POST", req)):
            check_401(*s.request(method, path, b), "%s without a key" % path)
            for bad in ("Bearer " + KEY[:-1], "Bearer " + KEY + "x", "Bearer " + KEY.upper(),
                        "Basic " + KEY, KEY, "Bearer ", "Bearer x" + KEY[1:]):
                check_401(*s.request(method, path, b, headers={"Authorization": bad}), bad)
        st, _, data = s.request("GET", "/v1/models", headers=ok)
        assert st == 200, data
        st, _, data = s.request("POST", CMPL, req, headers={"Authorization": "bearer  " + KEY})
        assert st == 200 and json.loads(data)["choices"][0]["finish_reason"] == "length", data
        for path in ("/health", "/metrics"):
            st, _, _ = s.request("GET", path)
            assert st == 200, path
        m = s.metrics()
        assert m['lfserve_http_responses_total{code="401"}'] == 2 + 2 * 7, m
        assert s.stop() == 0

        # --- --api-key-file (wins over the environment) and --auth-metrics ------------------
        kf = os.path.join(tmp, "key")
        with open(kf, "w") as f:
            f.write(KEY + "2\n")
        os.chmod(kf, 0o600)
        s = Server(a.lfserve, model, "--pools", "1", "--threads", "1", "--api-key-file", kf,
                   "--auth-metrics", env=dict(env, LFSERVE_API_KEY="other"),
                   health_headers={"Authorization": "Bearer " + KEY + "2"})
        servers.append(s)
        log = s.read_log()
        assert "auth: an API key (--api-key-file) on every endpoint" in log, log
        assert "can be read by other users" not in log, log
        ok2 = {"Authorization": "Bearer " + KEY + "2"}
        for path in ("/health", "/metrics", "/v1/models"):
            check_401(*s.request("GET", path), path + " without a key")
            check_401(*s.request("GET", path, headers={"Authorization": "Bearer other"}),
                      path + " with the environment's key")
            st, _, _ = s.request("GET", path, headers=ok2)
            assert st == 200, path
        assert s.stop() == 0

        # --- refused configurations -----------------------------------------------------------
        for args, want in ((["--api-key", KEY], "visible to every user"),
                           (["--api-key-file", os.path.join(tmp, "missing")], "No such file"),
                           (["--api-key-file", "/dev/null"], "the API key is empty")):
            r = subprocess.run([a.lfserve, "--model", model] + args, capture_output=True,
                               text=True, timeout=60)
            assert r.returncode == 2 and want in r.stderr, (args, r.returncode, r.stderr)
            assert KEY not in r.stderr, r.stderr

        # --- the default address is loopback only ---------------------------------------------
        p, port, logf = start_raw(a.lfserve, model)
        try:
            assert listen_addrs(port) == ["127.0.0.1"], listen_addrs(port)
            assert "on http://127.0.0.1:%d" % port in open(logf).read()
        finally:
            stop_raw(p)
        p, port, logf = start_raw(a.lfserve, model, "--host", "0.0.0.0")
        try:
            assert listen_addrs(port) == ["0.0.0.0"], listen_addrs(port)
            assert "beyond this machine, without an API key" in open(logf).read()
        finally:
            stop_raw(p)

    return run_suite(body)


if __name__ == "__main__":
    sys.exit(main())
