"""What tools/make_gguf_models.py, tools/make_gguf_testdata.py and tools/evict/model.py share."""


def rotary_permute(w, n_head):
    """Hugging Face -> GGUF row order of q/k (convert_hf_to_gguf.py's permute): within each head
    the two rotary halves are interleaved, row i*(hd/2) + j going to row 2*j + i."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).copy()


def rotary_unpermute(w, n_head):
    """The inverse of rotary_permute: GGUF -> Hugging Face row order of q/k (what
    engine/model_gguf.c undoes at load)."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).copy()


def write_out(w):
    """Writes a gguf.GGUFWriter's header, metadata and tensors, and closes it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
