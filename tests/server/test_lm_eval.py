#!/usr/bin/env python3
"""EleutherAI's lm-evaluation-harness (pip `lm-eval`) against lfserve's /v1/completions on
SmolLM2-135M-Instruct: a tiny loglikelihood task over local data (written here, no download),
run through lm-eval's `local-completions` model (echo + logprobs with token-id prompts, as it
asks any OpenAI-compatible server), and every loglikelihood it reports compared with
transformers' (float32 logits, log-softmax in float64) on the same token ids, within 1e-3.

Exits 77 (skipped) when lm-eval (with its [api] extra, tenacity), torch, transformers, gguf,
accelerate or the model is missing. Measured: worst |diff| 1.9e-5 over the four requests.

    python3 tests/server/test_lm_eval.py --lfserve build-cpu/lfserve
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import ROOT, Server, run_suite  # noqa: E402

try:
    import accelerate  # noqa: F401
    import gguf  # noqa: F401
    import torch
    import transformers
    import lm_eval
    import tenacity  # noqa: F401  (lm-eval's API models need it: lm-eval[api])
    from lm_eval.tasks import TaskManager
except ImportError as e:
    print("SKIP: %s" % e)
    sys.exit(77)

TOL = 1e-3
DOCS = [
    {"context": "The capital of France is", "continuation": " Paris"},
    {"context": "One, two, three, four,", "continuation": " five, six"},
    {"context": "Water boils at a temperature of", "continuation": " 100 degrees Celsius"},
    {"context": "The cat sat on the", "continuation": " mat and purred"},
]
TASK = """task: lfserve_tiny_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfserve", required=True)
    a = ap.parse_args()
    path = smollm2()
    torch.set_num_threads(2)
    d, n = os.path.dirname(path), os.path.basename(path)
    tmp = tempfile.mkdtemp(prefix="lfserve-lmeval-")
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=n)
    tok_dir = os.path.join(tmp, "tokenizer")
    tok.save_pretrained(tok_dir)  # lm-eval tokenizes the requests with it, offline
    data = os.path.join(tmp, "data.jsonl")
    with open(data, "w") as f:
        for doc in DOCS:
            f.write(json.dumps(doc) + "\n")
    with open(os.path.join(tmp, "lfserve_tiny_ll.yaml"), "w") as f:
        f.write(TASK.format(data=data))
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=n,
                                                              dtype=torch.float32).eval()

    def body(servers):
        s = Server(a.lfserve, path, "--pools", "1", "--threads", "2", "--policy", "full",
                   "--budget", "256", "--served-model-name", "smollm2")
        servers.append(s)
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args="model=smollm2,base_url=http://127.0.0.1:%d/v1/completions,"
                       "tokenizer=%s,tokenizer_backend=huggingface,tokenized_requests=True,"
                       "num_concurrent=1,max_retries=1" % (s.port, tok_dir),
            tasks=["lfserve_tiny_ll"], task_manager=TaskManager(include_path=tmp),
            log_samples=True)
        samples = out["samples"]["lfserve_tiny_ll"]
        assert len(samples) == len(DOCS), samples
        worst = 0.0
        for smp in samples:
            ctx, cont = smp["arguments"][0][0], smp["arguments"][0][1]
            ll = float(smp["resps"][0][0][0])
            # lm-eval's split: the whole string encoded, the context's tokens first
            whole = tok(ctx + cont, add_special_tokens=False)["input_ids"]
            n_ctx = len(tok(ctx, add_special_tokens=False)["input_ids"])
            with torch.no_grad():
                lg = model(torch.tensor([whole])).logits[0].double()
            lp = torch.log_softmax(lg, dim=-1)
            want = sum(lp[i - 1, whole[i]].item() for i in range(n_ctx, len(whole)))
            worst = max(worst, abs(ll - want))
            print("    %-45r lfserve %.5f transformers %.5f" % (ctx + cont, ll, want))
            assert abs(ll - want) < TOL, (ctx, cont, ll, want)
        print("    worst |diff| %.2e; acc %s" % (worst, out["results"]["lfserve_tiny_ll"]))
        assert s.stop() == 0
    return run_suite(body)


if __name__ == "__main__":
    sys.exit(main())
