#!/usr/bin/env python3
"""An HTTP load generator for lfserve (or any OpenAI-compatible completions endpoint that takes
token-id prompts): long-output requests, all at once or as a seeded Poisson process, each
streamed, timed on the client.

    python3 bench/http_load.py --url http://127.0.0.1:8000 --requests 64 --rate 4 \
        --prompt 2048 --output 512 [--seed 0] [--label NAME] [--json out.json]

Each request is a /v1/completions stream of --prompt random token ids (seeded, below
--vocab) with max_tokens --output and ignore_eos, so it generates exactly --output tokens
unless the server cuts it. Per request: TTFT (send -> first token), TPOT ((last - first) /
(tokens - 1)), tokens (from the stream's token_ids), the status. Reported: output tokens/s over
the run (all tokens / first send -> last finish), TTFT and TPOT p50 / p99 (nearest rank), the
requests that failed or came back short, and /metrics' lfserve_replica_routed_total before and
after (how many each replica served). Standard library only.
"""
import argparse
import http.client
import json
import math
import os
import platform
import random
import sys
import threading
import time
import urllib.parse


def pct(xs, p):
    """Nearest-rank percentile; 0 for an empty list."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))]


def metrics(host, port):
    """{name: value} of /metrics, {} when it cannot be read."""
    try:
        c = http.client.HTTPConnection(host, port, timeout=10)
        c.request("GET", "/metrics")
        r = c.getresponse()
        data = r.read().decode()
        c.close()
    except OSError:
        return {}
    out = {}
    for line in data.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def routed(m):
    out = {}
    for k, v in m.items():
        if k.startswith('lfserve_replica_routed_total{replica="'):
            out[int(k.split('"')[1])] = int(v)
    return out


def one(host, port, model, prompt, n_out, timeout, res):
    """Streams one completion into res (a dict)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n_out, "ignore_eos": True,
                       "stream": True, "return_token_ids": True, "temperature": 0})
    t0 = time.perf_counter()
    res.update(send=t0, first=None, last=None, tokens=0, status=None, error=None)
    try:
        c = http.client.HTTPConnection(host, port, timeout=timeout)
        c.request("POST", "/v1/completions", body=body,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        res["status"] = r.status
        if r.status != 200:
            res["error"] = r.read()[:300].decode(errors="replace")
            c.close()
            return
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                res["error"] = ev["error"].get("message", "error")
                continue
            n = len(ev["choices"][0].get("token_ids") or []) if ev.get("choices") else 0
            if n:
                now = time.perf_counter()
                if res["first"] is None:
                    res["first"] = now
                res["last"] = now
                res["tokens"] += n
        c.close()
    except (OSError, ValueError, http.client.HTTPException) as e:
        res["error"] = "%s: %s" % (type(e).__name__, e)
    res["end"] = time.perf_counter()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="", help="the request's model field (default: /v1/models' first)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--output", type=int, default=128, help="output tokens")
    ap.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn from [1, vocab)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--label", default="", help="a name for this run in the JSON")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    if a.requests < 1 or a.prompt < 1 or a.output < 1 or a.vocab < 2 or a.rate < 0:
        ap.error("--requests, --prompt, --output must be >= 1, --vocab >= 2, --rate >= 0")
    u = urllib.parse.urlparse(a.url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    model = a.model
    if not model:
        c = http.client.HTTPConnection(host, port, timeout=10)
        c.request("GET", "/v1/models")
        model = json.loads(c.getresponse().read())["data"][0]["id"]
        c.close()
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(1, a.vocab) for _ in range(a.prompt)] for _ in range(a.requests)]
    gaps = [rng.expovariate(a.rate) if a.rate > 0 else 0.0 for _ in range(a.requests)]
    before = routed(metrics(host, port))
    results = [dict() for _ in range(a.requests)]
    threads = []
    start = time.perf_counter()
    t_next = start
    for i in range(a.requests):
        t_next += gaps[i] if i else 0.0
        d = t_next - time.perf_counter()
        if d > 0:
            time.sleep(d)
        th = threading.Thread(target=one, args=(host, port, model, prompts[i], a.output,
                                                a.timeout, results[i]), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(a.timeout + 30)
    after = routed(metrics(host, port))
    ok = [r for r in results if r.get("status") == 200 and not r.get("error") and
          r.get("tokens") == a.output]
    failed = [r for r in results if r not in ok]
    toks = sum(r.get("tokens", 0) for r in results)
    t_end = max((r.get("end", start) for r in results), default=start)
    wall = max(t_end - start, 1e-9)
    ttft = [r["first"] - r["send"] for r in ok]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    out = {
        "what": "lfserve over HTTP: streamed completions, client-side timing (bench/http_load.py)",
        "label": a.label, "url": a.url, "model": model, "requests": a.requests,
        "arrival": "poisson" if a.rate > 0 else "all at once", "rate": a.rate,
        "prompt_tokens": a.prompt, "output_tokens": a.output, "seed": a.seed,
        "completed": len(ok), "failed": len(failed),
        "failures": [{"status": r.get("status"), "tokens": r.get("tokens"), "error": r.get("error")}
                     for r in failed[:5]],
        "wall_s": round(wall, 3), "output_tokens_per_s": round(toks / wall, 2),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
        "routed": {str(k): after.get(k, 0) - before.get(k, 0) for k in sorted(after)},
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print("%s: %d/%d requests, %.1f output tokens/s, TTFT p50 %.3f s p99 %.3f s, TPOT p50 %.2f ms "
          "p99 %.2f ms, routed %s" % (a.label or model, len(ok), a.requests,
                                       out["output_tokens_per_s"], out["ttft_p50_s"],
                                       out["ttft_p99_s"], 1e3 * out["tpot_p50_s"],
                                       1e3 * out["tpot_p99_s"], out["routed"]))
    for f in out["failures"]:
        print("  failed: %s" % f)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
