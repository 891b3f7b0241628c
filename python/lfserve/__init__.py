"""lfserve for Python: an LLM engine with fixed-size evicting KV slot pools, over the C library
(include/lfserve.h) through ctypes.

    import lfserve
    with lfserve.Engine("models/trace", backend="cpu") as engine:
        print(engine.generate("Once upon a time", max_tokens=32))
        for piece in engine.stream("Once upon a time", max_tokens=32):
            print(piece, end="")

Every failing call raises LfserveError with the library's status and message.
"""

from __future__ import annotations

import ctypes
from collections import deque
from typing import Deque, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from . import _lib

__all__ = ["Engine", "LfserveError", "Prompt", "library_version", "library_path",
           "read_key_means"]
__version__ = "0.5.0"

# A prompt: text, token ids, or chat messages ({"role": ..., "content": ...}).
Prompt = Union[str, Sequence[int], Sequence[Mapping[str, str]]]


class LfserveError(RuntimeError):
    """A call into lfserve failed. `status` is the lf_status name (e.g. "LF_ERR_IO"), `code`
    its value, `message` the library's own description (lf_last_error)."""

    def __init__(self, code: int, message: str, what: str = "") -> None:
        self.code = code
        self.status = (_lib.STATUS_NAMES[code] if 0 <= code < len(_lib.STATUS_NAMES)
                       else f"lf_status {code}")
        self.message = message
        super().__init__(f"{what + ': ' if what else ''}{self.status}: {message}")


def _check(code: int, what: str) -> None:
    if code != 0:
        msg = _lib.load().lf_last_error()
        raise LfserveError(code, msg.decode("utf-8", "replace") if msg else "", what)


def library_version() -> str:
    """The loaded C library's version ("0.5.0")."""
    return _lib.load().lf_version().decode()


def library_path() -> str:
    """The path of the loaded liblfserve.so."""
    return _lib.load()._name


def read_key_means(path: str) -> List[float]:
    """The values of a key-means file (lfgen's --key-means; tools/evict/key_means.py writes one):
    the header `lfserve-key-means layers L kv_heads H head_dim D`, then L x H x D numbers, '#'
    comments; for Engine(key_means=...), which checks them against the model."""
    toks = []
    with open(path) as f:
        for line in f:
            toks += line.split("#", 1)[0].replace(",", " ").split()
    head = ["lfserve-key-means", "layers", None, "kv_heads", None, "head_dim", None]
    if len(toks) < 7 or any(h is not None and t != h for h, t in zip(head, toks)):
        raise LfserveError(f"{path}: no 'lfserve-key-means layers L kv_heads H head_dim D' header")
    L, H, D = int(toks[2]), int(toks[4]), int(toks[6])
    vals = [float(x) for x in toks[7:]]
    if len(vals) != L * H * D:
        raise LfserveError(f"{path}: {len(vals)} values where the header announces {L * H * D}")
    return vals


def _parse(fn_name: str, value: str) -> int:
    out = ctypes.c_int(0)
    _check(getattr(_lib.load(), fn_name)(value.encode(), ctypes.byref(out)), fn_name)
    return out.value


class _Stream:
    """One request's state inside an Engine: its undelivered text and how it ended."""

    def __init__(self, detok: ctypes.c_void_p) -> None:
        self.detok = detok
        self.pieces: Deque[str] = deque()
        self.tokens: List[int] = []
        self.finished = False
        self.reason = ""
        self.error: Optional[LfserveError] = None


class Engine:
    """A loaded model with its KV pools and scheduler (lf_engine_init on one rank).

    model: a Hugging Face directory, a GGUF file or a llama2.c .bin (lf_engine_config.model_path);
    text prompts and text output need a model that carries a tokenizer.
    backend "auto" | "cpu" | "cuda"; policy "longflow" | "full" | "streaming" | "h2o" | "rkv";
    budget: KV slots per pool (0: the model's context); n_pools: concurrent sequences (0: the
    backend decides; the cpu backend's default is 1, so give more to run requests together);
    kv_dtype "bf16" | "fp8" | "int8" | "int4" | "k8v4"; evict_scope "layer" | "head"; lora: a PEFT
    adapter directory; chat_template: a built-in chat format ("chatml", "llama3", "deepseek-r1")
    for message prompts, instead of the model's own; layer_weights: one weight per layer for
    per-layer budgets in the same total (lf_engine_config.layer_weights); key_means: the
    n_layers x n_kv_heads x head_dim values (flat) taken from every key before the pools store it
    (lf_engine_config.key_means; tools/evict/key_means.py writes them, read_key_means reads a file).
    """

    def __init__(self, model: str, *, backend: str = "auto", policy: str = "longflow",
                 budget: int = 0, n_pools: int = 0, kv_dtype: str = "bf16",
                 evict_scope: Optional[str] = None, max_batch_tokens: Optional[int] = None,
                 n_threads: int = 0, lora: Optional[str] = None,
                 chat_template: Optional[str] = None,
                 layer_weights: Optional[Sequence[float]] = None,
                 key_means: Optional[Sequence[float]] = None) -> None:
        lib = _lib.load()
        self._lib = lib
        self._engine = ctypes.c_void_p()
        self._tok = ctypes.c_void_p()
        self._streams: Dict[int, _Stream] = {}
        self._model = model
        self._chat_template = chat_template
        cfg = _lib.EngineConfig()
        lib.lf_engine_config_default(ctypes.byref(cfg))
        self._path_bytes = model.encode()
        self._lora_bytes = lora.encode() if lora else None
        cfg.model_path = self._path_bytes
        cfg.backend = _parse("lf_backend_parse", backend)
        cfg.policy = _parse("lf_policy_parse", policy)
        cfg.kv_dtype = _parse("lf_kv_dtype_parse", kv_dtype)
        if evict_scope is not None:
            cfg.evict_scope = _parse("lf_evict_scope_parse", evict_scope)
        if max_batch_tokens is not None:
            cfg.max_batch_tokens = max_batch_tokens
        cfg.budget, cfg.n_pools, cfg.n_threads = budget, n_pools, n_threads
        cfg.lora_path = self._lora_bytes
        if layer_weights is not None:  # per-layer budgets (lf_engine_config.layer_weights)
            w = [float(x) for x in layer_weights]
            self._layer_weights = (ctypes.c_double * len(w))(*w)
            cfg.layer_weights = ctypes.cast(self._layer_weights, ctypes.POINTER(ctypes.c_double))
            cfg.n_layer_weights = len(w)
        if key_means is not None:  # lf_engine_config.key_means
            mu = [float(x) for x in key_means]
            self._key_means = (ctypes.c_float * len(mu))(*mu)
            cfg.key_means = ctypes.cast(self._key_means, ctypes.POINTER(ctypes.c_float))
            cfg.n_key_means = len(mu)
        _check(lib.lf_engine_init(ctypes.byref(cfg), None, ctypes.byref(self._engine)),
               f"loading {model}")
        # the tokenizer is optional: without one, prompts and outputs are token ids
        code = lib.lf_tokenizer_open(self._path_bytes, ctypes.byref(self._tok))
        self._no_tokenizer = ""
        if code != 0:
            self._no_tokenizer = (lib.lf_last_error() or b"").decode("utf-8", "replace")
            self._tok = ctypes.c_void_p()
            if code != 4:  # LF_ERR_UNSUPPORTED: the model has none; anything else is an error
                self.close()
                _check(code, f"the tokenizer of {model}")

    # ---- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Frees the engine, its tokenizer and every request's state. Idempotent."""
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        for st in self._streams.values():
            lib.lf_detokenizer_free(st.detok)
        self._streams.clear()
        if self._engine:
            lib.lf_engine_free(self._engine)
            self._engine = ctypes.c_void_p()
        if self._tok:
            lib.lf_tokenizer_free(self._tok)
            self._tok = ctypes.c_void_p()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def _live(self) -> ctypes.c_void_p:
        if not self._engine:
            raise LfserveError(13, "the engine is closed", "Engine")
        return self._engine

    # ---- model and text ------------------------------------------------------------------------

    @property
    def model_info(self) -> Dict[str, object]:
        """The model's facts: model_type, vocab_size, n_layers, n_heads, n_kv_heads, head_dim,
        dim, hidden_dim, max_seq_len, bos_id, eos_ids."""
        mi = _lib.ModelInfo()
        _check(self._lib.lf_engine_model_info(self._live(), ctypes.byref(mi)), "model_info")
        out: Dict[str, object] = {name: getattr(mi, name) for name, _ in mi._fields_
                                  if name not in ("model_type", "eos_ids", "n_eos")}
        out["model_type"] = mi.model_type.decode()
        out["eos_ids"] = list(mi.eos_ids[: mi.n_eos])
        return out

    @property
    def resolved_config(self) -> Dict[str, object]:
        """The settings the engine runs with, defaults resolved (lf_engine_resolved_config):
        backend, policy, evict_scope, kv_dtype (names), budget (the model's context when 0 was
        given), sink, window, h2o_recent, rkv_stage, n_pools, max_batch_tokens, max_queue,
        max_seq_len, n_ranks, rkv_obs, budget_min, budget_max (per-layer budgets)."""
        rc = _lib.ResolvedConfig()
        _check(self._lib.lf_engine_resolved_config(self._live(), ctypes.byref(rc)),
               "resolved_config")
        out: Dict[str, object] = {name: getattr(rc, name) for name, _ in rc._fields_}
        for name in ("backend", "policy", "evict_scope", "kv_dtype"):
            out[name] = getattr(self._lib, f"lf_{name}_str")(getattr(rc, name)).decode()
        return out

    @property
    def has_tokenizer(self) -> bool:
        """Whether the model carries a tokenizer (text prompts and text output)."""
        return bool(self._tok)

    def _need_tokenizer(self) -> ctypes.c_void_p:
        self._live()
        if not self._tok:
            raise LfserveError(4, f"no tokenizer: {self._no_tokenizer}; pass token ids", "Engine")
        return self._tok

    def _take_ids(self, code: int, ids: "ctypes._Pointer[ctypes.c_int32]", n: ctypes.c_int,
                  what: str) -> List[int]:
        _check(code, what)
        out = [ids[i] for i in range(n.value)]
        self._lib.lf_free(ids)
        return out

    def tokenize(self, text: str, add_special: bool = True) -> List[int]:
        """Token ids of text; add_special adds what the tokenizer's template adds (BOS)."""
        ids, n = ctypes.POINTER(ctypes.c_int32)(), ctypes.c_int(0)
        code = self._lib.lf_tokenize(self._need_tokenizer(), text.encode(), int(add_special),
                                     ctypes.byref(ids), ctypes.byref(n))
        return self._take_ids(code, ids, n, "tokenize")

    def tokenize_chat(self, messages: Sequence[Mapping[str, str]]) -> List[int]:
        """Token ids of chat messages in the model's chat template (or the Engine's
        chat_template), ending with the assistant's turn opened."""
        arr = (_lib.ChatMessage * len(messages))()
        keep = []
        for i, m in enumerate(messages):
            role, content = m["role"].encode(), m["content"].encode()
            keep += [role, content]
            arr[i].role, arr[i].content = role, content
        ids, n = ctypes.POINTER(ctypes.c_int32)(), ctypes.c_int(0)
        fmt = self._chat_template.encode() if self._chat_template else None
        code = self._lib.lf_tokenize_chat(self._need_tokenizer(), self._path_bytes, fmt, arr,
                                          len(messages), ctypes.byref(ids), ctypes.byref(n))
        return self._take_ids(code, ids, n, "tokenize_chat")

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens left out."""
        arr = (ctypes.c_int32 * len(ids))(*ids)
        text = ctypes.c_void_p()
        _check(self._lib.lf_detokenize(self._need_tokenizer(), arr, len(ids), ctypes.byref(text)),
               "detokenize")
        try:
            return ctypes.string_at(text.value).decode("utf-8", "replace")
        finally:
            self._lib.lf_free(text)

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, prompt: Prompt, max_tokens: int = 128, *, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int = 0, ignore_eos: bool = False,
               stop_ids: Sequence[int] = (), presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
               logit_bias: Optional[Mapping[int, float]] = None) -> int:
        """Queues a request and returns its id; its output comes from `next_pieces` / `stream`.
        prompt: text (encoded with BOS where the tokenizer adds one), token ids, or chat
        messages. Sampling is greedy at temperature 0. presence/frequency penalties (OpenAI),
        repetition_penalty (Hugging Face / vLLM) and logit_bias {token id: bias in [-100, 100]}
        as in lf_sampling (include/lfserve.h)."""
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        elif len(prompt) and isinstance(prompt[0], Mapping):
            ids = self.tokenize_chat(prompt)  # type: ignore[arg-type]
        else:
            ids = [int(t) for t in prompt]  # type: ignore[union-attr]
        arr = (ctypes.c_int32 * len(ids))(*ids)
        stops = (ctypes.c_int32 * len(stop_ids))(*stop_ids)
        rq = _lib.Request()
        rq.prompt, rq.n_prompt, rq.max_tokens = arr, len(ids), max_tokens
        rq.sampling = _lib.Sampling(temperature, top_k, top_p, seed)
        rq.sampling.presence_penalty = presence_penalty
        rq.sampling.frequency_penalty = frequency_penalty
        rq.sampling.repetition_penalty = repetition_penalty
        bias = (_lib.LogitBias * len(logit_bias or {}))(
            *[_lib.LogitBias(int(k), float(v)) for k, v in (logit_bias or {}).items()])
        if logit_bias:
            rq.sampling.logit_bias, rq.sampling.n_logit_bias = bias, len(logit_bias)
        rq.ignore_eos = int(ignore_eos)
        if stop_ids:
            rq.stop_ids, rq.n_stop_ids = stops, len(stop_ids)
        rid = ctypes.c_uint64(0)
        _check(self._lib.lf_engine_submit(self._live(), ctypes.byref(rq), ctypes.byref(rid)),
               "submit")
        detok = ctypes.c_void_p()
        if self._tok:
            _check(self._lib.lf_detokenizer_init(self._tok, ctypes.byref(detok)), "detokenizer")
        self._streams[rid.value] = _Stream(detok)
        return rid.value

    def cancel(self, request_id: int) -> None:
        """Cancels a waiting or running request; its stream then ends."""
        _check(self._lib.lf_engine_cancel(self._live(), request_id), "cancel")

    def step(self) -> None:
        """Runs one engine iteration and files its events under their requests."""
        ev = (_lib.Event * 64)()
        n = ctypes.c_int(0)
        _check(self._lib.lf_engine_step(self._live(), ev, 64, ctypes.byref(n)), "step")
        for e in ev[: n.value]:
            st = self._streams.get(e.id)
            if st is None:
                continue
            if e.type == _lib.EVENT_TOKEN:
                st.tokens.append(e.token)
                if st.detok:
                    st.pieces.append(self._detok_call("lf_detokenizer_put", st.detok, e.token))
                else:
                    st.pieces.append(f"{e.token} ")
            elif e.type == _lib.EVENT_FINISH:
                if st.detok:
                    st.pieces.append(self._detok_call("lf_detokenizer_flush", st.detok))
                st.finished = True
                st.reason = self._lib.lf_finish_reason_str(e.reason).decode()
                if e.reason == _lib.FINISH_ERROR:
                    st.error = LfserveError(e.status, (self._lib.lf_last_error() or b"").decode(
                        "utf-8", "replace"), f"request {e.id}")

    def _detok_call(self, name: str, detok: ctypes.c_void_p, *token: int) -> str:
        text, size = ctypes.c_void_p(), ctypes.c_size_t(0)
        _check(getattr(self._lib, name)(detok, *token, ctypes.byref(text), ctypes.byref(size)),
               name)
        return ctypes.string_at(text.value, size.value).decode("utf-8", "replace") if size.value else ""

    def stream_request(self, request_id: int) -> Iterator[str]:
        """Yields a submitted request's text as it is generated (whole UTF-8 characters; token
        ids separated by spaces when the model has no tokenizer), stepping the engine as needed.
        Other requests' output is kept for their own streams. Raises LfserveError when the
        request ends in an error."""
        st = self._streams[request_id]
        try:
            while True:
                while st.pieces:
                    piece = st.pieces.popleft()
                    if piece:
                        yield piece
                if st.finished:
                    if st.error:
                        raise st.error
                    return
                self.step()
        finally:
            self._streams.pop(request_id, None)
            if st.detok:
                self._lib.lf_detokenizer_free(st.detok)
                st.detok = ctypes.c_void_p()
            if not st.finished and self._engine:
                self._lib.lf_engine_cancel(self._engine, request_id)  # abandoned mid-stream

    def stream(self, prompt: Prompt, max_tokens: int = 128, **sampling: object) -> Iterator[str]:
        """Submits a request and yields its text as it is generated (see `submit` for the
        arguments and `stream_request` for what is yielded)."""
        return self.stream_request(self.submit(prompt, max_tokens, **sampling))  # type: ignore[arg-type]

    def generate(self, prompt: Prompt, max_tokens: int = 128, **sampling: object) -> str:
        """The whole generated text of one request (see `submit` for the arguments)."""
        return "".join(self.stream(prompt, max_tokens, **sampling))

    def generate_many(self, prompts: Sequence[Prompt], max_tokens: int = 128,
                      **sampling: object) -> List[str]:
        """The generated texts of several requests run together (batched in the same steps as
        far as the engine's pools allow), in the order of prompts."""
        ids = [self.submit(p, max_tokens, **sampling) for p in prompts]  # type: ignore[arg-type]
        return ["".join(self.stream_request(i)) for i in ids]

    def request_stats(self, request_id: int) -> Dict[str, object]:
        """Statistics of a waiting, running or recently finished request: prompt_tokens,
        generated_tokens, evictions, slots_filled, output_tokens, prefill_chunks, reason,
        status and the queue / ttft / tpot / total seconds."""
        rs = _lib.RequestStats()
        _check(self._lib.lf_engine_request_stats(self._live(), request_id, ctypes.byref(rs)),
               "request_stats")
        out: Dict[str, object] = {name: getattr(rs, name) for name, _ in rs._fields_}
        out["reason"] = self._lib.lf_finish_reason_str(rs.reason).decode()
        return out
