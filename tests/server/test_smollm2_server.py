#!/usr/bin/env python3
"""lfserve serving SmolLM2-135M-Instruct from its bare GGUF file, driven by the official `openai`
client: the chat endpoint renders the model's own template (from the GGUF metadata) and encodes
it with the model's own tokenizer, so a greedy chat completion must give the same prompt length
and the same tokens as `lfgen --chat` on the same message; streamed output equals the whole
answer; a LongFlow budget below the sequence length evicts and still answers.
Exits 77 (skipped) when the openai package or the model (tools/smollm2.sh) is missing."""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Server  # noqa: E402

try:
    import openai
except ImportError:
    print("SKIP: the openai package is not installed")
    sys.exit(77)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUESTION = "List, step by step, what to pack for a two-day hike in the mountains."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfserve", required=True)
    ap.add_argument("--lfgen", required=True)
    a = ap.parse_args()
    gguf = os.environ.get("LF_SMOLLM2_GGUF")
    if not gguf:
        r = subprocess.run(["bash", os.path.join(ROOT, "tools/smollm2.sh")], capture_output=True,
                           text=True)
        if r.returncode != 0:
            print("SKIP: SmolLM2 is not installed (tools/smollm2.sh): " + r.stderr.strip())
            sys.exit(77)
        gguf = r.stdout.strip()
    n = 48
    ref = subprocess.run([a.lfgen, "--model", gguf, "--backend", "cpu", "--chat", "--prompt",
                          QUESTION, "--max-tokens", str(n), "--temperature", "0", "--policy",
                          "full", "--ignore-eos", "--print-ids"],
                         capture_output=True, text=True, check=True)
    ref_ids = [int(x) for x in ref.stdout.split()]
    ref_prompt = int(ref.stderr.split(" prompt + ")[0].split()[-1])
    assert len(ref_ids) == n, ref.stdout

    s = Server(a.lfserve, gguf, "--pools", "4", "--threads", "1", "--budget", "160",
               "--policy", "longflow", "--served-model-name", "smollm2")
    ok = False
    try:
        client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % s.port, api_key="none",
                               max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        msgs = [{"role": "user", "content": QUESTION}]
        r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=n,
                                           temperature=0,
                                           extra_body={"ignore_eos": True,
                                                       "return_token_ids": True})
        whole = r.choices[0].message.content
        got = r.model_dump()["choices"][0].get("token_ids")  # lfserve's extension field
        print("prompt tokens %d (lfgen %d); answer: %r" % (r.usage.prompt_tokens, ref_prompt,
                                                           whole[:200]))
        assert r.usage.prompt_tokens == ref_prompt, (r.usage.prompt_tokens, ref_prompt)
        assert r.usage.completion_tokens == n
        assert got == ref_ids, (got, ref_ids)  # budget 160 > prompt + 48: nothing evicted yet
        assert len(whole) > 40, whole
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}) if c.choices]
        assert "".join(parts) == whole, (parts, whole)
        # Past the budget: LongFlow evicts, the request still completes with text.
        r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=200,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 200 and len(r.choices[0].message.content) > 200
        ev = s.metrics().get("lfserve_evictions_total", 0)
        print("evictions:", ev)
        assert ev > 0, ev
        ok = True
    finally:
        rc = s.stop()
        if not ok or rc != 0:
            print(s.read_log()[-4000:])
    print("PASS" if ok and rc == 0 else "FAIL")
    sys.exit(0 if ok and rc == 0 else 1)


if __name__ == "__main__":
    main()
