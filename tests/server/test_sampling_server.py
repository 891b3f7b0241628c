#!/usr/bin/env python3
"""The sampling parameters and log-probabilities over HTTP, on a tiny random Llama with a
byte-level BPE tokenizer (tools/make_tiny_chat_model.py), standard library only:

- logit_bias: a bias of 100 on one token at temperature 1 makes every token that one;
- seed: the same seed gives the same text, other seeds other text (temperature 1), and a request
  gives the same text alone and beside concurrent neighbours;
- presence/frequency/repetition penalties change a greedy answer (test_sampling_params checks
  their arithmetic);
- logprobs: chat's content[] and completions' columns have OpenAI's shapes, streamed chunks carry
  the same values as the whole body, echo puts the prompt (and its logprobs, first null) first;
- members the server does not act on are a 400 naming them; `user` is accepted.

    python3 tests/server/test_sampling_server.py --lfserve build/lfserve
"""
import argparse
import os
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Server, make_tiny_chat_model, run_suite  # noqa: E402

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = "Once upon a time there was"


def ok(s, path, body):
    st, _, j, raw = s.post(path, body)
    assert st == 200, (st, raw[:500])
    return j


def check_bias_and_penalties(s):
    j = ok(s, CMPL, {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 3,
                     "logit_bias": {"65": 100}, "return_token_ids": True, "ignore_eos": True})
    assert j["choices"][0]["token_ids"] == [65] * 12, j
    # a bias of -100 on the greedy answer's first token moves it
    g = ok(s, CMPL, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                     "return_token_ids": True, "ignore_eos": True})["choices"][0]["token_ids"]
    b = ok(s, CMPL, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                     "logit_bias": {str(g[0]): -100}, "return_token_ids": True})
    assert b["choices"][0]["token_ids"][0] != g[0], (g, b)
    # (this random model does not repeat itself: penalties that reward repeats show)
    for extra in ({"presence_penalty": -2.0}, {"frequency_penalty": -2.0},
                  {"repetition_penalty": 0.1}):
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        body.update(extra)
        p = ok(s, CMPL, body)["choices"][0]["token_ids"]
        g24 = ok(s, CMPL, {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                           "return_token_ids": True})["choices"][0]["token_ids"]
        assert p != g24, extra


def check_seeds(s):
    def text(seed, out=None, i=None):
        t = ok(s, CMPL, {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": seed,
                         "ignore_eos": True})["choices"][0]["text"]
        if out is not None:
            out[i] = t
        return t
    a = text(1234)
    assert text(1234) == a
    others = [text(k) for k in (1, 2, 3)]
    assert all(o != a for o in others), (a, others)
    # beside neighbours (other seeds and prompts, in the same batches): the same text
    out = [None] * 4
    th = [threading.Thread(target=text, args=(seed, out, i)) for i, seed in enumerate((7, 1234, 8, 9))]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert out[1] == a, (out, a)


def check_logprobs(s):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "ignore_eos": True}
    j = ok(s, CHAT, body)
    content = j["choices"][0]["logprobs"]["content"]
    assert len(content) == 6, content
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}, e
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 3
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)
        assert abs(tops[0] - e["logprob"]) < 1e-6  # greedy: the top one was taken
    # streamed: one chunk per token with the same values
    body["stream"] = True
    st, chunks, done = s.stream(CHAT, body)
    assert st == 200 and done
    streamed = [c["choices"][0]["logprobs"]["content"][0] for c in chunks
                if c["choices"] and c["choices"][0].get("logprobs")]
    assert [e["logprob"] for e in streamed] == [e["logprob"] for e in content], (streamed, content)
    # without logprobs: null
    assert ok(s, CHAT, {"messages": [{"role": "user", "content": "Hi"}],
                        "max_tokens": 2})["choices"][0]["logprobs"] is None

    # completions: columns, echo with the prompt's logprobs
    j = ok(s, CMPL, {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2,
                     "echo": True, "ignore_eos": True, "return_token_ids": True})
    c = j["choices"][0]
    lp = c["logprobs"]
    n_prompt = len(c["prompt_token_ids"])
    assert j["usage"]["prompt_tokens"] == n_prompt
    assert len(lp["tokens"]) == n_prompt + 5 == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    assert c["text"].startswith(PROMPT), c["text"]
    # the tokens' strings make the text, special ones (the BOS here) aside
    special = [t.startswith("<|") and t.endswith("|>") for t in lp["tokens"]]
    assert special[0] and not any(special[1:]), lp["tokens"]
    assert "".join(lp["tokens"][1:]) == c["text"], (lp["tokens"], c["text"])
    offs = lp["text_offset"]
    assert offs[0] == 0 and offs[1] == 0
    assert all(offs[i + 1] == offs[i] + len(lp["tokens"][i].encode())
               for i in range(1, len(offs) - 1)), offs
    for i in range(1, len(lp["tokens"])):
        tops = lp["top_logprobs"][i]
        assert 1 <= len(tops) <= 3 and lp["tokens"][i] in tops, tops
    # the same without echo: the generated part
    k = ok(s, CMPL, {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2,
                     "ignore_eos": True})["choices"][0]["logprobs"]
    assert k["token_logprobs"] == lp["token_logprobs"][n_prompt:], (k, lp)
    # streamed with echo: the prompt's chunk first, then one per token
    st, chunks, done = s.stream(CMPL, {"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                       "logprobs": 2, "echo": True, "ignore_eos": True,
                                       "stream": True})
    assert st == 200 and done
    lps = [x for ch in chunks if ch["choices"] and ch["choices"][0]["logprobs"]
           for x in ch["choices"][0]["logprobs"]["token_logprobs"]]
    assert lps == lp["token_logprobs"], (lps, lp["token_logprobs"])
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == c["text"]


def check_refusals(s):
    for path, extra in ((CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}),
                        (CHAT, {"functions": [{"name": "f"}]}),
                        (CHAT, {"response_format": {"type": "json_object"}}),
                        (CHAT, {"n": 2}),
                        (CHAT, {"echo": True}),
                        (CHAT, {"logprobs": False, "top_logprobs": 2}),
                        (CMPL, {"suffix": "x"}),
                        (CMPL, {"logprobs": 6}),
                        (CMPL, {"best_of": 2}),
                        (CMPL, {"logit_bias": {"5": 200}}),
                        (CMPL, {"whatever": 1})):
        body = {"messages": [{"role": "user", "content": "Hi"}]} if path == CHAT else {"prompt": "x"}
        body["max_tokens"] = 2
        body.update(extra)
        st, _, j, raw = s.post(path, body)
        assert st == 400, (extra, st, raw)
        assert j["error"]["param"] == list(extra)[-1], (extra, j)
    ok(s, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "user": "u1",
                 "response_format": {"type": "text"}, "tools": None})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfserve", required=True)
    a = ap.parse_args()
    model = make_tiny_chat_model(os.path.join(tempfile.mkdtemp(prefix="lfserve-sp-"), "tinychat"))

    def body(servers):
        s = Server(a.lfserve, model, "--pools", "4", "--threads", "1", "--max-batch-tokens", "8")
        servers.append(s)
        for fn in (check_bias_and_penalties, check_seeds, check_logprobs, check_refusals):
            fn(s)
            print("ok  " + fn.__name__)
        assert s.stop() == 0, s.read_log()[-3000:]
    return run_suite(body)


if __name__ == "__main__":
    sys.exit(main())
