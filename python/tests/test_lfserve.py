"""Tests of the Python package over the C library, on the CPU backend with the repository's
checked-in models (models/trace: a character-level tokenizer; tests/data/hf_tiny/llama: none).
Run with pytest, or as a script where pytest is not installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import lfserve

REPO = Path(__file__).resolve().parents[2]
TRACE = str(REPO / "models" / "trace")
TINY = str(REPO / "tests" / "data" / "hf_tiny" / "llama")
PROMPT = "init a4 b1 c9 d9 e7\na=a-b\nb=b+c@2\nrun 03\n"


def raises(fn, *args, **kwargs) -> lfserve.LfserveError:
    try:
        fn(*args, **kwargs)
    except lfserve.LfserveError as e:
        return e
    raise AssertionError(f"{fn.__name__} did not raise LfserveError")


def test_version_and_library() -> None:
    assert lfserve.library_version() == lfserve.__version__
    assert os.path.basename(lfserve.library_path()).startswith("liblfserve.so")


def test_generate_stream_and_ids_agree() -> None:
    with lfserve.Engine(TRACE, backend="cpu") as eng:
        text = eng.generate(PROMPT, max_tokens=40)
        assert len(text) > 0
        pieces = list(eng.stream(PROMPT, max_tokens=40))
        assert len(pieces) > 1, "streamed in pieces"
        assert "".join(pieces) == text, "greedy: the stream equals the whole generation"
        ids = eng.tokenize(PROMPT)
        assert eng.generate(ids, max_tokens=40) == text, "token-id prompt, same output"


def test_sampling_parameters_reach_the_engine() -> None:
    with lfserve.Engine(TRACE, backend="cpu") as eng:
        tok = eng.tokenize("a")[-1]
        forced = eng.generate(PROMPT, max_tokens=6, temperature=1.0, seed=4,
                              logit_bias={tok: 100.0})
        assert forced == "a" * 6, forced
        plain = eng.generate(PROMPT, max_tokens=30)
        assert eng.generate(PROMPT, max_tokens=30, presence_penalty=-2.0,
                            repetition_penalty=0.5) != plain
        e = raises(eng.generate, PROMPT, max_tokens=2, logit_bias={tok: 101.0})
        assert e.status == "LF_ERR_INVALID_ARG" and "logit_bias" in str(e)


def test_generate_equals_lfgen() -> None:
    lfgen = os.environ.get("LFGEN") or shutil.which("lfgen")
    if not lfgen:
        for b in ("build", "build-cpu"):
            if (REPO / b / "lfgen").exists():
                lfgen = str(REPO / b / "lfgen")
                break
    if not lfgen:
        print("lfgen not found: skipped")
        return
    ref = subprocess.run([lfgen, "--model", TRACE, "--prompt", PROMPT, "--max-tokens", "40",
                          "--backend", "cpu"], capture_output=True, text=True, check=True).stdout
    with lfserve.Engine(TRACE, backend="cpu") as eng:
        assert eng.generate(PROMPT, max_tokens=40) == ref.rstrip("\n")


def test_generate_many_runs_requests_together() -> None:
    prompts = [PROMPT, "init a1 b2\na=a+b\nrun 02\n"]
    with lfserve.Engine(TRACE, backend="cpu", n_pools=2) as eng:
        alone = [eng.generate(p, max_tokens=30) for p in prompts]
        assert eng.generate_many(prompts, max_tokens=30) == alone
        # two interleaved streams of one engine
        a = eng.stream(prompts[0], max_tokens=30)
        b = eng.stream(prompts[1], max_tokens=30)
        got_a, got_b = [], []
        for pa, pb in zip(a, b):
            got_a.append(pa)
            got_b.append(pb)
        got_a += list(a)
        got_b += list(b)
        assert ["".join(got_a), "".join(got_b)] == alone


def test_tokenize_round_trip_and_stats() -> None:
    with lfserve.Engine(TRACE, backend="cpu", budget=64, policy="longflow") as eng:
        ids = eng.tokenize(PROMPT, add_special=False)
        assert eng.detokenize(ids) == PROMPT
        assert eng.tokenize(PROMPT)[0] == eng.model_info["bos_id"]
        info = eng.model_info
        assert info["model_type"] == "llama" and info["n_layers"] == 6
        rc = eng.resolved_config
        assert rc["backend"] == "cpu" and rc["policy"] == "longflow" and rc["budget"] == 64
        assert rc["max_seq_len"] == info["max_seq_len"] and rc["n_pools"] >= 1
        rid = eng.submit(PROMPT, max_tokens=80, ignore_eos=True)
        text = "".join(eng.stream_request(rid))
        st = eng.request_stats(rid)
        assert st["generated_tokens"] == 80 and st["reason"] == "length"
        assert st["evictions"] > 0, "a 64-slot budget evicts"
        assert len(text) > 0


def test_layer_weights() -> None:
    # six layers: 64 x 6 = 384 slots, the last layer weighted 3x (a share of 3/8: 144)
    with lfserve.Engine(TRACE, backend="cpu", budget=64, policy="h2o",
                        layer_weights=[1, 1, 1, 1, 1, 3]) as eng:
        rc = eng.resolved_config
        assert rc["budget"] == 64 and rc["budget_min"] == 48 and rc["budget_max"] == 144, rc
        rid = eng.submit(PROMPT, max_tokens=60, ignore_eos=True)
        assert len("".join(eng.stream_request(rid))) > 0
    try:
        lfserve.Engine(TRACE, backend="cpu", budget=64, policy="h2o", layer_weights=[1, 2])
        raise AssertionError("two weights for six layers were accepted")
    except lfserve.LfserveError as e:
        assert "2 weights for a model of 6 layers" in str(e), e


def test_key_means() -> None:
    with lfserve.Engine(TRACE, backend="cpu") as eng:
        info = eng.model_info
    n = info["n_layers"] * info["n_kv_heads"] * info["head_dim"]
    # a zero mean is no mean: the same greedy text; a file round-trips through read_key_means
    tmp = tempfile.TemporaryDirectory()
    f = Path(tmp.name) / "means.txt"
    f.write_text("# test\nlfserve-key-means layers %d kv_heads %d head_dim %d\n%s\n" % (
        info["n_layers"], info["n_kv_heads"], info["head_dim"], " ".join(["0"] * n)))
    mu = lfserve.read_key_means(str(f))
    assert len(mu) == n and not any(mu), mu[:4]
    outs = []
    for km in (None, mu):
        with lfserve.Engine(TRACE, backend="cpu", budget=64, key_means=km) as eng:
            rid = eng.submit(PROMPT, max_tokens=40, ignore_eos=True)
            outs.append("".join(eng.stream_request(rid)))
    assert outs[0] == outs[1], outs
    try:
        lfserve.Engine(TRACE, backend="cpu", key_means=[0.0] * (n - 1))
        raise AssertionError("a short key mean was accepted")
    except lfserve.LfserveError as e:
        assert "key_means" in str(e), e


def test_abandoned_stream_is_cancelled() -> None:
    with lfserve.Engine(TRACE, backend="cpu") as eng:
        it = eng.stream(PROMPT, max_tokens=200, ignore_eos=True)
        next(it)
        it.close()  # the request is cancelled; the engine serves the next one
        assert eng.generate(PROMPT, max_tokens=10)


def test_errors_carry_the_library_message() -> None:
    e = raises(lfserve.Engine, "/nonexistent/model", backend="cpu")
    assert e.status.startswith("LF_ERR_") and "/nonexistent/model" in e.message, e
    e = raises(lfserve.Engine, TRACE, policy="lru")
    assert e.status == "LF_ERR_INVALID_ARG" and "longflow" in e.message, e
    with lfserve.Engine(TRACE, backend="cpu") as eng:
        e = raises(eng.generate, [10**6], max_tokens=4)  # an id outside the vocabulary
        assert e.status == "LF_ERR_INVALID_ARG", e
        e = raises(eng.generate, [{"role": "user", "content": "hi"}], max_tokens=4)
        assert e.status == "LF_ERR_UNSUPPORTED" and "template" in e.message, e
    eng.close()
    assert raises(eng.generate, PROMPT).status == "LF_ERR_STATE"


def test_model_without_tokenizer() -> None:
    with lfserve.Engine(TINY, backend="cpu") as eng:
        assert not eng.has_tokenizer
        e = raises(eng.generate, "hello", max_tokens=4)
        assert e.status == "LF_ERR_UNSUPPORTED" and "tokenizer" in e.message, e
        out = eng.generate([1, 2, 3], max_tokens=5, ignore_eos=True)
        assert len(out.split()) == 5 and all(t.isdigit() for t in out.split())


if __name__ == "__main__":  # without pytest: run every test_ function
    failed = 0
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"PASSED {name}")
            except Exception as exc:  # noqa: BLE001
                failed += 1
                print(f"FAILED {name}: {exc!r}")
    sys.exit(1 if failed else 0)
