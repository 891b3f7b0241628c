"""What tools/make_gguf_models.py and tools/make_gguf_testdata.py share."""


def rotary_permute(w, n_head):
    """Hugging Face -> GGUF row order of q/k (convert_hf_to_gguf.py's permute): within each head
    the two rotary halves are interleaved, row i*(hd/2) + j going to row 2*j + i."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).copy()


def write_out(w):
    """Writes a gguf.GGUFWriter's header, metadata and tensors, and closes it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
