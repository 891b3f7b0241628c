/* One-shot all-reduce over CUDA IPC peer memory, for the small messages of tensor-parallel
 * decoding (GPU ranks of one node, NVLink or PCIe peer access).
 *
 * NCCL's all-reduce costs ~35 us of device time per call at 8 KB-4 MB on 2 x H200 (measured:
 * bench/RESULTS.md), and a Llama decode step makes 2 per layer. Here every rank maps every
 * other rank's buffer (cudaIpcOpenMemHandle) once at start-up, and one kernel per call: copies
 * its input into its own buffer, raises a flag in every peer's buffer, waits for the peers'
 * flags, then sums all ranks' buffers in rank order 0..T-1 (fp32 accumulation) into the output
 * (two kernels: the copy, then flags + sum; see ar_ipc.cu for why).
 * Every rank therefore gets the same bits. Two buffers alternate between calls, and a rank can
 * be at most one call ahead of any peer (it cannot finish a call before all peers started it),
 * so no buffer is overwritten while a peer still reads it. The call is a plain kernel launch:
 * it can be captured into a CUDA graph.
 *
 * A peer that never arrives: the kernel gives up after the timeout (%globaltimer), raises an
 * error flag in host-mapped memory and returns, so the stream always drains; the communicator's
 * waits check the flag (lf_ar_ipc_failed) and fail the job as for an NCCL error.
 *
 * Set up through parallel/comm_nccl.c (which exchanges the handles), opt-in with LF_CUSTOM_AR=1
 * until measured again: on 2 x H200 the one-kernel version (8.4-13 us from 8 KB to 1 MB against
 * NCCL's 32-38 us) and this two-kernel one (11.8-17 us) were counted wrong at some sizes, by a
 * check whose inputs were still uploading when the kernel started (lfbench comm, fixed since;
 * bench/RESULTS.md).
 */
#ifndef LF_AR_IPC_H
#define LF_AR_IPC_H

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LF_AR_MAX_RANKS 8

/* What a rank publishes to the others (fixed size, a multiple of 4 bytes). */
typedef struct lf_ar_record {
  char host[64];
  int32_t device;     /* CUDA ordinal on that host */
  int32_t ok;         /* the region was allocated */
  unsigned char handle[64]; /* cudaIpcMemHandle_t */
} lf_ar_record;

typedef struct lf_ar_ipc lf_ar_ipc;

/* Allocates this rank's region on the current device (data capacity `cap` bytes per buffer)
 * and fills *rec. On failure rec->ok is 0 (and *out NULL); the caller still publishes rec. */
lf_status lf_ar_ipc_prepare(size_t cap, double timeout_s, lf_ar_ipc **out, lf_ar_record *rec);

/* Maps the peers' regions from the records of all ranks (recs[size]). Returns LF_OK when this
 * rank can take part; the ranks must then agree (all OK) before any call. */
lf_status lf_ar_ipc_attach(lf_ar_ipc *a, int rank, int size, const lf_ar_record *recs);

/* 1 when a call of `bytes` at buf can take this path (size, 16-byte alignment). */
int lf_ar_ipc_fits(const lf_ar_ipc *a, const void *buf, size_t bytes);

/* In place: buf[n] = sum over ranks; bf16 = 1 for bfloat16 elements, else fp32. */
lf_status lf_ar_ipc_run(lf_ar_ipc *a, void *buf, size_t n, int bf16, void *stream);

/* 1 once a call gave up waiting for a peer. */
int lf_ar_ipc_failed(const lf_ar_ipc *a);

/* device_ok = 0: leaves the device memory alone (a failed job exiting). */
void lf_ar_ipc_free(lf_ar_ipc *a, int device_ok);

#ifdef __cplusplus
}
#endif
#endif
