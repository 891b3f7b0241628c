"""What tools/serve_load.py and tools/soak.py share: the greedy reference of each prompt, the
text of a stream, and the verdict at the end."""


def reference(s, i, prompt, max_tokens, timeout):
    """Prompt i's greedy reference on server s, completions for even i, chat for odd: (chat, path,
    body, token ids, text, stop), stop being a 3-character string from the middle of the text
    whose first occurrence is there (None when there is none)."""
    chat = i % 2 == 1
    body = {"max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    st, _, j, raw = s.post(path, body, timeout=timeout)
    assert st == 200, raw
    ch = j["choices"][0]
    text = ch["message"]["content"] if chat else ch["text"]
    stop = next((text[k:k + 3] for k in range(len(text) // 3, len(text) - 3)
                 if text.find(text[k:k + 3]) == k and text[k:k + 3].strip()), None)
    return chat, path, body, ch["token_ids"], text, stop


def stream_text(chunks, chat):
    """The token ids and the text of a stream's chunks."""
    ids, text = [], ""
    for c in chunks:
        for ch in c["choices"]:
            ids += ch.get("token_ids", [])
            text += ch["delta"].get("content", "") if chat else ch["text"]
    return ids, text


def verdict(s, rc, ok, errors):
    """Prints the first errors, the server's log when it exited with rc != 0, and PASS or FAIL;
    returns the exit status."""
    for e in errors[:10]:
        print("  " + e)
    if rc != 0:
        print("lfserve exited with %s:\n%s" % (rc, s.read_log()[-4000:]))
        ok = False
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def run_all(threads):
    """Starts the threads and waits for all of them."""
    for t in threads:
        t.start()
    for t in threads:
        t.join()
