#!/usr/bin/env python3
"""The official `openai` Python client against lfserve (completions and chat, whole and
streamed, and its error mapping). Exits 77 (skipped) when the package is not installed."""
import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Server, make_tiny_chat_model  # noqa: E402

try:
    import openai
except ImportError:
    print("SKIP: the openai package is not installed")
    sys.exit(77)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfserve", required=True)
    a = ap.parse_args()
    model = make_tiny_chat_model(os.path.join(tempfile.mkdtemp(prefix="lfoai-"), "tinychat"))
    s = Server(a.lfserve, model, "--pools", "4", "--threads", "1")
    ok = False
    try:
        client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % s.port, api_key="none",
                               max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tinychat"]
        r = client.completions.create(model="tinychat", prompt="Hello", max_tokens=6,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="tinychat", prompt="Hello", max_tokens=6, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
        assert text == r.choices[0].text, (text, r.choices[0].text)
        msgs = [{"role": "user", "content": "Hi there"}]
        r = client.chat.completions.create(model="tinychat", messages=msgs, max_tokens=6,
                                           extra_body={"ignore_eos": True})
        whole = r.choices[0].message.content
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tinychat", messages=msgs, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}) if c.choices]
        assert "".join(parts) == whole, (parts, whole)
        try:
            client.completions.create(model="tinychat", prompt="x", max_tokens=0)
            raise AssertionError("max_tokens=0 accepted")
        except openai.BadRequestError:
            pass
        try:
            client.completions.create(model="nope", prompt="x")
            raise AssertionError("unknown model accepted")
        except openai.NotFoundError:
            pass
        ok = True
    finally:
        rc = s.stop()
        if not ok or rc != 0:
            print(s.read_log()[-4000:])
    print("PASS" if ok and rc == 0 else "FAIL")
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
