#!/usr/bin/env python3
"""lfgen's command-line limits and messages, and its eviction count under tensor parallelism.

    python3 tests/server/test_lfgen.py --lfgen build/lfgen [--mpiexec mpiexec]

Without --mpiexec (label cpu): --max-tokens beyond the context fails (exit 2) as the server
answers 400; --chat on a model without a chat template fails clearly unless --chat-template
names one; a model too big for the memory fails at once with the figures. With --mpiexec
(label mpi): `mpiexec -np 2 lfgen` generates the ids one rank does, reports the same eviction
count (over every KV head of the model, each counted once) and says "tp 2" in its stats line.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import ROOT, make_tiny_chat_model  # noqa: E402


def run(cmd, env=None, timeout=120):
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=timeout, env=env)
    return p.returncode, p.stdout, p.stderr, time.time() - t0


def model_for_tp():
    data = os.environ.get("LF_TEST_DATA", os.path.join(ROOT, "..", "shared"))
    bin_ = os.path.join(data, "models", "stories260K", "stories260K.bin")
    if os.path.exists(bin_):
        return bin_, "500"
    return os.path.join(ROOT, "tests", "data", "hf_tiny", "llama"), "300"


def tests_cli(lfgen):
    model, _ = model_for_tp()
    rc, out, err, _ = run([lfgen, "--model", model, "--prompt-ids", "1", "--max-tokens", "100000"])
    assert rc == 2 and "exceed the model's context" in err, (rc, err)
    rc, out, err, _ = run([lfgen, "--model", model, "--prompt-ids", "1", "--max-tokens", "8",
                           "--print-ids", "--ignore-eos"])
    assert rc == 0 and len(out.split()) == 8, (rc, out, err)
    print("ok  --max-tokens beyond the context: exit 2")

    tmp = tempfile.mkdtemp(prefix="lfgen-test-")
    try:
        bare = make_tiny_chat_model(os.path.join(tmp, "bare"))
        cfgp = os.path.join(bare, "tokenizer_config.json")
        with open(cfgp) as f:
            cfg = json.load(f)
        cfg.pop("chat_template", None)
        with open(cfgp, "w") as f:
            json.dump(cfg, f)
        rc, out, err, _ = run([lfgen, "--model", bare, "--prompt", "hi", "--chat"])
        assert rc == 2 and "no chat template" in err and "--chat-template" in err, (rc, err)
        rc, out, err, _ = run([lfgen, "--model", bare, "--prompt", "hi", "--chat", "--chat-template",
                               "chatml", "--max-tokens", "4", "--ignore-eos", "--print-ids"])
        assert rc == 0 and len(out.split()) == 4, (rc, out, err)
        rc, out, err, _ = run([lfgen, "--model", bare, "--prompt", "hi", "--chat", "--chat-template",
                               "qwen3"])
        assert rc == 2 and "unknown chat template" in err, (rc, err)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("ok  --chat without a template: a clear error; --chat-template chatml works")

    rc, out, err, dt = run([lfgen, "--model", "random:llama3-70b", "--prompt-ids", "1",
                            "--max-tokens", "2", "--backend", "cpu"], timeout=60)
    assert rc == 1 and "MemAvailable" in err and "GiB" in err, (rc, err)
    assert dt < 20, dt
    print("ok  a model too big for the memory fails in %.1f s: %s" % (dt, err.strip()[-160:]))


def stats(err):
    m = re.search(r"evictions (\d+)", err)
    assert m, err
    return int(m.group(1))


def tests_tp(lfgen, mpiexec):
    model, n = model_for_tp()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    args = [lfgen, "--model", model, "--prompt-ids", "1,2,3", "--max-tokens", n, "--policy",
            "longflow", "--budget", "64", "--ignore-eos", "--print-ids", "--backend", "cpu"]
    rc, out1, err1, _ = run(args, env=env)
    assert rc == 0, err1
    assert "tp " not in err1.splitlines()[-1], err1
    ev1 = stats(err1)
    assert ev1 > 0, err1
    for np in (2, 4):
        rc, out, err, _ = run([mpiexec, "-np", str(np), "--oversubscribe"] + args, env=env, timeout=300)
        assert rc == 0, err
        assert out == out1, "%d ranks generated other ids" % np
        assert "tp %d" % np in err, err
        assert stats(err) == ev1, (np, stats(err), ev1)
        print("ok  mpiexec -np %d: the ids and eviction count (%d) of one rank, 'tp %d' in the stats"
              % (np, ev1, np))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfgen", required=True)
    ap.add_argument("--mpiexec")
    a = ap.parse_args()
    try:
        if a.mpiexec:
            tests_tp(a.lfgen, a.mpiexec)
        else:
            tests_cli(a.lfgen)
    except AssertionError as e:
        print("FAIL: %r" % (e,))
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
