#!/usr/bin/env python3
"""lfserve's log-probabilities against transformers on SmolLM2-135M-Instruct (its Q4_1 GGUF,
which transformers dequantizes at load as lfserve does, so both run the same weights), through
the server on the cpu backend:

- /v1/completions with echo and logprobs: every prompt token's logprob (after the first) and
  every generated token's, against log_softmax (in float64) of transformers' float32 logits at
  the same positions, within 1e-3; the top alternatives likewise;
- /v1/chat/completions with logprobs: the generated tokens' logprobs, the same way.

The logprobs are the raw model distribution's (lfserve's documented choice), so they are
compared with transformers' plain log-softmax even though the requests sample at temperature 1
with penalties. Exits 77 (skipped) without torch/transformers/gguf or the model.

    python3 tests/server/test_logprobs_reference.py --lfserve build-cpu/lfserve
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import ROOT, Server, run_suite  # noqa: E402

try:
    import torch
    import transformers
    import accelerate  # noqa: F401  (transformers needs it to load a GGUF file)
    import gguf  # noqa: F401  (transformers reads GGUF files through it)
except ImportError as e:
    print("SKIP: %s" % e)
    sys.exit(77)

TOL = 1e-3
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


def smollm2():
    p = os.environ.get("LF_SMOLLM2_GGUF")
    if p:
        return p
    r = subprocess.run(["bash", os.path.join(ROOT, "tools/smollm2.sh")], capture_output=True,
                       text=True)
    if r.returncode != 0:
        print("SKIP: SmolLM2 is not installed (tools/smollm2.sh): " + r.stderr.strip())
        sys.exit(77)
    return r.stdout.strip()


def reference_logprobs(model, ids):
    """log_softmax over the logits at every position of ids, float64: [len(ids)][vocab]."""
    with torch.no_grad():
        out = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(out, dim=-1)


def compare(ref, ids, start, got, tops, what):
    """got[k]: lfserve's logprob of ids[start + k] given ids[:start + k]; tops[k]: its top
    alternatives {token id: logprob} (or None)."""
    worst = 0.0
    for k, lp in enumerate(got):
        pos = start + k
        want = ref[pos - 1, ids[pos]].item()
        worst = max(worst, abs(lp - want))
        assert abs(lp - want) < TOL, "%s: position %d token %d: %.6f vs transformers %.6f" % (
            what, pos, ids[pos], lp, want)
        for tid, tlp in (tops[k] or {}).items():
            assert abs(tlp - ref[pos - 1, tid].item()) < TOL, (what, pos, tid)
    print("    %s: %d logprobs, worst |diff| %.2e" % (what, len(got), worst))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfserve", required=True)
    a = ap.parse_args()
    path = smollm2()
    torch.set_num_threads(2)
    d, n = os.path.dirname(path), os.path.basename(path)
    # float32: transformers may keep GGUF weights packed and compute in float32 whatever dtype is
    # asked; the comparison is then transformers' float32 against lfserve's fp32 cpu backend,
    # the log-softmax of both in float64
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=n,
                                                              dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=n)

    def body(servers):
        s = Server(a.lfserve, path, "--pools", "2", "--threads", "2", "--policy", "full",
                   "--budget", "256", "--max-batch-tokens", "16", "--served-model-name", "smollm2")
        servers.append(s)
        # completions: echo + logprobs (the prompt runs in 16-token chunks)
        prompt = "The quick brown fox jumps over the lazy dog. In the morning, the farmer"
        st, _, j, raw = s.post(CMPL, {"prompt": prompt, "max_tokens": 12, "temperature": 1.0,
                                      "seed": 11, "presence_penalty": 0.5, "logprobs": 5,
                                      "echo": True, "return_token_ids": True,
                                      "ignore_eos": True})
        assert st == 200, raw
        c = j["choices"][0]
        p_ids, g_ids = c["prompt_token_ids"], c["token_ids"]
        assert p_ids == tok(prompt)["input_ids"], (p_ids, tok(prompt)["input_ids"])
        ids = p_ids + g_ids
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None
        ref = reference_logprobs(model, ids)
        # tops come keyed by token string: map back through the ids where the string is unique
        def tops_by_id(i):
            t = lp["top_logprobs"][i]
            out = {}
            for sid in torch.topk(ref[i - 1], 8).indices.tolist():
                s_ = tok.decode([sid])
                if s_ in t:
                    out[sid] = t[s_]
            return out
        compare(ref, ids, 1, lp["token_logprobs"][1:len(p_ids)],
                [tops_by_id(i) for i in range(1, len(p_ids))], "completion prompt (echo)")
        compare(ref, ids, len(p_ids), lp["token_logprobs"][len(p_ids):],
                [tops_by_id(i) for i in range(len(p_ids), len(ids))], "completion output")
        # chat: the generated tokens' logprobs and top_logprobs
        msgs = [{"role": "user", "content": "Name three colours."}]
        st, _, j, raw = s.post(CHAT, {"messages": msgs, "max_tokens": 12, "temperature": 0,
                                      "logprobs": True, "top_logprobs": 4, "ignore_eos": True,
                                      "return_token_ids": True})
        assert st == 200, raw
        c = j["choices"][0]
        g_ids = c["token_ids"]
        p_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(p_ids, dict) or hasattr(p_ids, "keys"):
            p_ids = p_ids["input_ids"]
        assert j["usage"]["prompt_tokens"] == len(p_ids), (j["usage"], len(p_ids))
        ids = list(p_ids) + g_ids
        ref = reference_logprobs(model, ids)
        content = c["logprobs"]["content"]
        compare(ref, ids, len(p_ids), [e["logprob"] for e in content], [None] * len(content),
                "chat output")
        for k, e in enumerate(content):
            want = torch.topk(ref[len(p_ids) + k - 1], 4)
            got = [t["logprob"] for t in e["top_logprobs"]]
            assert max(abs(x - y) for x, y in zip(got, want.values.tolist())) < TOL, (k, got)
        assert s.stop() == 0
    return run_suite(body)


if __name__ == "__main__":
    sys.exit(main())
