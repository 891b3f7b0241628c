"""The C library, loaded with ctypes: where it is found, the struct layouts of include/lfserve.h
and the function prototypes."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
from pathlib import Path
from typing import List, Optional

LIB_NAME = "liblfserve.so"

# lf_status, in the order of include/lfserve.h
STATUS_NAMES = [
    "LF_OK", "LF_ERR_INVALID_ARG", "LF_ERR_IO", "LF_ERR_FORMAT", "LF_ERR_UNSUPPORTED",
    "LF_ERR_SHAPE", "LF_ERR_MISSING_TENSOR", "LF_ERR_OUT_OF_MEMORY", "LF_ERR_CONTEXT_FULL",
    "LF_ERR_QUEUE_FULL", "LF_ERR_NOT_FOUND", "LF_ERR_BACKEND", "LF_ERR_UNAVAILABLE",
    "LF_ERR_STATE", "LF_ERR_INTERNAL",
]
EVENT_TOKEN, EVENT_FINISH, EVENT_PROMPT_TOKEN = 0, 1, 2
FINISH_ERROR = 4


class EngineConfig(ctypes.Structure):
    _fields_ = [
        ("model_path", ctypes.c_char_p), ("backend", ctypes.c_int), ("policy", ctypes.c_int),
        ("budget", ctypes.c_int), ("sink", ctypes.c_int), ("window", ctypes.c_int),
        ("n_pools", ctypes.c_int), ("max_batch_tokens", ctypes.c_int),
        ("max_queue", ctypes.c_int), ("n_threads", ctypes.c_int),
        ("kv_memory_bytes", ctypes.c_uint64), ("mem_util", ctypes.c_double),
        ("evict_scope", ctypes.c_int), ("evict_groups", ctypes.c_int),
        ("lora_path", ctypes.c_char_p), ("h2o_recent", ctypes.c_int), ("kv_dtype", ctypes.c_int),
        ("host_mem_util", ctypes.c_double), ("max_pools", ctypes.c_int), ("rkv_stage", ctypes.c_int),
        ("rkv_obs", ctypes.c_int), ("layer_weights", ctypes.POINTER(ctypes.c_double)),
        ("n_layer_weights", ctypes.c_int), ("key_means", ctypes.POINTER(ctypes.c_float)),
        ("n_key_means", ctypes.c_int),
    ]


class ModelInfo(ctypes.Structure):
    _fields_ = [
        ("model_type", ctypes.c_char * 32), ("vocab_size", ctypes.c_int),
        ("n_layers", ctypes.c_int), ("n_heads", ctypes.c_int), ("n_kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int), ("dim", ctypes.c_int), ("hidden_dim", ctypes.c_int),
        ("max_seq_len", ctypes.c_int), ("bos_id", ctypes.c_int),
        ("eos_ids", ctypes.c_int * 8), ("n_eos", ctypes.c_int),
    ]


class ResolvedConfig(ctypes.Structure):
    _fields_ = [
        ("backend", ctypes.c_int), ("policy", ctypes.c_int), ("evict_scope", ctypes.c_int),
        ("kv_dtype", ctypes.c_int), ("budget", ctypes.c_int), ("sink", ctypes.c_int),
        ("window", ctypes.c_int), ("h2o_recent", ctypes.c_int), ("rkv_stage", ctypes.c_int),
        ("n_pools", ctypes.c_int), ("max_batch_tokens", ctypes.c_int),
        ("max_queue", ctypes.c_int), ("max_seq_len", ctypes.c_int), ("n_ranks", ctypes.c_int),
        ("rkv_obs", ctypes.c_int), ("budget_min", ctypes.c_int), ("budget_max", ctypes.c_int),
    ]


MAX_TOP_LOGPROBS = 20


class LogitBias(ctypes.Structure):
    _fields_ = [("token", ctypes.c_int32), ("bias", ctypes.c_float)]


class Sampling(ctypes.Structure):
    _fields_ = [("temperature", ctypes.c_float), ("top_k", ctypes.c_int),
                ("top_p", ctypes.c_float), ("seed", ctypes.c_uint64),
                ("presence_penalty", ctypes.c_float), ("frequency_penalty", ctypes.c_float),
                ("repetition_penalty", ctypes.c_float), ("n_logit_bias", ctypes.c_int),
                ("logit_bias", ctypes.POINTER(LogitBias)), ("logprobs", ctypes.c_int),
                ("top_logprobs", ctypes.c_int), ("prompt_logprobs", ctypes.c_int)]


class Request(ctypes.Structure):
    _fields_ = [
        ("prompt", ctypes.POINTER(ctypes.c_int32)), ("n_prompt", ctypes.c_int),
        ("max_tokens", ctypes.c_int), ("sampling", Sampling), ("ignore_eos", ctypes.c_int),
        ("stop_ids", ctypes.POINTER(ctypes.c_int32)), ("n_stop_ids", ctypes.c_int),
        ("stop_seqs", ctypes.c_void_p), ("n_stop_seqs", ctypes.c_int),
        ("forced", ctypes.POINTER(ctypes.c_int32)), ("n_forced", ctypes.c_int),
    ]


class Event(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("type", ctypes.c_int), ("token", ctypes.c_int32),
                ("reason", ctypes.c_int), ("status", ctypes.c_int), ("logprob", ctypes.c_float),
                ("n_top", ctypes.c_int), ("top_ids", ctypes.c_int32 * MAX_TOP_LOGPROBS),
                ("top_logprobs", ctypes.c_float * MAX_TOP_LOGPROBS)]


class RequestStats(ctypes.Structure):
    _fields_ = [
        ("prompt_tokens", ctypes.c_int), ("generated_tokens", ctypes.c_int),
        ("evictions", ctypes.c_uint64), ("slots_filled", ctypes.c_int),
        ("output_tokens", ctypes.c_int), ("prefill_chunks", ctypes.c_int),
        ("reason", ctypes.c_int), ("status", ctypes.c_int),
        ("queue_seconds", ctypes.c_double), ("ttft_seconds", ctypes.c_double),
        ("tpot_seconds", ctypes.c_double), ("total_seconds", ctypes.c_double),
    ]


class ChatMessage(ctypes.Structure):
    _fields_ = [("role", ctypes.c_char_p), ("content", ctypes.c_char_p)]


_LAYOUTS = {"lf_engine_config": EngineConfig, "lf_model_info": ModelInfo,
            "lf_sampling": Sampling, "lf_request": Request, "lf_event": Event,
            "lf_request_stats": RequestStats, "lf_chat_message": ChatMessage,
            "lf_logit_bias": LogitBias, "lf_resolved_config": ResolvedConfig}

_P = ctypes.c_void_p
_I32P = ctypes.POINTER(ctypes.c_int32)
_PROTOTYPES = {
    # name: (restype, argtypes)
    "lf_version": (ctypes.c_char_p, []),
    "lf_abi_sizeof": (ctypes.c_size_t, [ctypes.c_char_p]),
    "lf_free": (None, [_P]),
    "lf_status_str": (ctypes.c_char_p, [ctypes.c_int]),
    "lf_last_error": (ctypes.c_char_p, []),
    "lf_backend_parse": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]),
    "lf_policy_parse": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]),
    "lf_evict_scope_parse": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]),
    "lf_kv_dtype_parse": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]),
    "lf_finish_reason_str": (ctypes.c_char_p, [ctypes.c_int]),
    "lf_backend_str": (ctypes.c_char_p, [ctypes.c_int]),
    "lf_policy_str": (ctypes.c_char_p, [ctypes.c_int]),
    "lf_evict_scope_str": (ctypes.c_char_p, [ctypes.c_int]),
    "lf_kv_dtype_str": (ctypes.c_char_p, [ctypes.c_int]),
    "lf_engine_config_default": (None, [ctypes.POINTER(EngineConfig)]),
    "lf_engine_init": (ctypes.c_int, [ctypes.POINTER(EngineConfig), _P, ctypes.POINTER(_P)]),
    "lf_engine_free": (None, [_P]),
    "lf_engine_model_info": (ctypes.c_int, [_P, ctypes.POINTER(ModelInfo)]),
    "lf_engine_resolved_config": (ctypes.c_int, [_P, ctypes.POINTER(ResolvedConfig)]),
    "lf_engine_submit": (ctypes.c_int, [_P, ctypes.POINTER(Request), ctypes.POINTER(ctypes.c_uint64)]),
    "lf_engine_step": (ctypes.c_int, [_P, ctypes.POINTER(Event), ctypes.c_int, ctypes.POINTER(ctypes.c_int)]),
    "lf_engine_busy": (ctypes.c_int, [_P]),
    "lf_engine_cancel": (ctypes.c_int, [_P, ctypes.c_uint64]),
    "lf_engine_request_stats": (ctypes.c_int, [_P, ctypes.c_uint64, ctypes.POINTER(RequestStats)]),
    "lf_tokenizer_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(_P)]),
    "lf_tokenizer_free": (None, [_P]),
    "lf_tokenize": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(_I32P),
                                   ctypes.POINTER(ctypes.c_int)]),
    "lf_tokenize_chat": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p,
                                        ctypes.POINTER(ChatMessage), ctypes.c_int,
                                        ctypes.POINTER(_I32P), ctypes.POINTER(ctypes.c_int)]),
    "lf_detokenize": (ctypes.c_int, [_P, _I32P, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]),
    "lf_detokenizer_init": (ctypes.c_int, [_P, ctypes.POINTER(_P)]),
    "lf_detokenizer_put": (ctypes.c_int, [_P, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p),
                                          ctypes.POINTER(ctypes.c_size_t)]),
    "lf_detokenizer_flush": (ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_void_p),
                                            ctypes.POINTER(ctypes.c_size_t)]),
    "lf_detokenizer_free": (None, [_P]),
}


def candidates() -> List[str]:
    """The places the shared library is looked for, in order (see python/README.md)."""
    out: List[str] = []
    env = os.environ.get("LFSERVE_LIB")
    if env:
        out.append(os.path.join(env, LIB_NAME) if os.path.isdir(env) else env)
    if shutil.which("pkg-config"):
        try:
            libdir = subprocess.run(["pkg-config", "--variable=libdir", "lfserve"],
                                    capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            libdir = ""
        if libdir:
            out.append(os.path.join(libdir, LIB_NAME))
    # a source checkout: python/lfserve/_lib.py -> <repo>/build*/liblfserve.so
    repo = Path(__file__).resolve().parent.parent.parent
    for build in ("build", "build-cpu"):
        out.append(str(repo / build / LIB_NAME))
    found = ctypes.util.find_library("lfserve")
    if found:
        out.append(found)
    for d in ("/usr/local/lib", "/usr/local/lib64", "/usr/lib", "/usr/lib64"):
        out.append(os.path.join(d, LIB_NAME))
    return out


_lib: Optional[ctypes.CDLL] = None


def load() -> ctypes.CDLL:
    """The loaded library with its prototypes set, loading it on the first call. Raises
    OSError naming every place tried when none holds a usable liblfserve.so."""
    global _lib
    if _lib is not None:
        return _lib
    tried = []
    for path in candidates():
        if os.sep in path and not os.path.exists(path):
            tried.append(f"{path} (absent)")
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({e})")
            continue
        if os.environ.get("LFSERVE_LIB") and not hasattr(lib, "lf_abi_sizeof"):
            tried.append(f"{path} (not lfserve 0.1 or later)")
            continue
        _bind(lib)
        _lib = lib
        return lib
    raise OSError("liblfserve.so not found; set LFSERVE_LIB to its path. Tried: " + "; ".join(tried))


def _bind(lib: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    for cname, struct in _LAYOUTS.items():
        want = lib.lf_abi_sizeof(cname.encode())
        if want != ctypes.sizeof(struct):
            raise OSError(f"{cname} is {want} bytes in {lib._name} but {ctypes.sizeof(struct)} "
                          "in this binding: the library and the Python package differ in version")
