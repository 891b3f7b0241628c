"""Shared helpers for the server tests: start lfserve on a free loopback port, make requests
with the standard library only (http.client), parse SSE streams."""
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))


def make_tiny_chat_model(out_dir, context=1024):
    subprocess.check_call([sys.executable, os.path.join(ROOT, "tools", "make_tiny_chat_model.py"),
                           out_dir, "--context", str(context)], stdout=subprocess.DEVNULL)
    return out_dir


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Server:
    def __init__(self, binary, model, *args, env=None, launcher=None, health_headers=None):
        """launcher: a command prefix, e.g. ["mpiexec", "-np", "2"] (rank 0 serves HTTP).
        health_headers: sent with the /health polls at start (a key under --auth-metrics)."""
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="lfserve-", suffix=".log", delete=False)
        cmd = list(launcher or []) + [binary, "--model", model, "--host", "127.0.0.1", "--port",
                                      str(self.port), "--backend", "cpu"] + list(args)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env or os.environ.copy())
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("lfserve exited: " + self.read_log())
            try:
                st, _, _ = self.request("GET", "/health", headers=health_headers, timeout=2)
                if st == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("lfserve did not come up: " + self.read_log())

    def read_log(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def conn(self, timeout=60):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method, path, body=None, headers=None, timeout=60):
        c = self.conn(timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body)
            h = {"Content-Type": "application/json"}
            h.update(headers or {})
            c.request(method, path, body=body, headers=h)
            r = c.getresponse()
            data = r.read()
            return r.status, dict((k.lower(), v) for k, v in r.getheaders()), data
        finally:
            c.close()

    def post(self, path, body, **kw):
        st, h, data = self.request("POST", path, body, **kw)
        try:
            j = json.loads(data)
        except ValueError:
            j = None
        return st, h, j, data

    def stream(self, path, body, timeout=120, first=None):
        """Returns (status, list of parsed chunks, saw_done). first(): called when the first
        body line arrives."""
        c = self.conn(timeout)
        try:
            c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                return r.status, [json.loads(r.read())], False
            chunks, done = [], False
            while True:
                line = r.readline()
                if first and line:
                    first()
                    first = None
                if not line:
                    break
                line = line.rstrip(b"\r\n")
                if not line:
                    continue
                assert line.startswith(b"data: "), line
                payload = line[6:]
                if payload == b"[DONE]":
                    done = True
                    continue
                assert not done, "data after [DONE]"
                chunks.append(json.loads(payload))
            return r.status, chunks, done
        finally:
            c.close()

    def metrics(self):
        st, _, data = self.request("GET", "/metrics")
        assert st == 200
        out = {}
        for line in data.decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        return rc


def wait_idle(srv, timeout=30):
    """Waits until no pool is used and nothing is queued; returns the metrics."""
    deadline = time.time() + timeout
    while True:
        m = srv.metrics()
        if (m["lfserve_pools_used"] == 0 and m["lfserve_queue_length"] == 0 and
                m["lfserve_requests_in_flight"] == 0):
            return m
        if time.time() > deadline:
            raise AssertionError("server not idle: %s" % {k: v for k, v in m.items()
                                                          if re.match("lfserve_(pools|queue|requests_in)", k)})
        time.sleep(0.05)


def run_suite(body):
    """Runs body(servers), where body appends every Server it starts to servers. On an
    exception: prints it, stops the servers and prints their logs. Leftover processes are
    killed either way. Prints PASS/FAIL and returns the exit code."""
    servers = []
    ok = True
    try:
        body(servers)
    except Exception:
        ok = False
        traceback.print_exc()
        for s in servers:
            s.stop()
            print("---- server log ----\n" + s.read_log()[-6000:])
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.proc.kill()
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
