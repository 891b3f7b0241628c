/* One-shot all-reduce over CUDA IPC peer memory, for the small messages of tensor-parallel
 * decoding (GPU ranks of one node, NVLink or PCIe peer access).
 *
 * NCCL's all-reduce has a fixed device-time cost per call that dominates at decode sizes
 * (8 KB-4 MB; bench/RESULTS.md), and a Llama decode step makes 2 per layer. Here every rank maps every
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
 * Set up through parallel/comm_nccl.c (which exchanges the handles), on unless LF_CUSTOM_AR=0:
 * below 1 MB it is several times faster than NCCL, and the fused residual call below shortens a
 * TP decode step (figures: bench/RESULTS.md).
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
#define LF_AR_SLOTS 3 /* staging buffers of the fused residual all-reduce */

/* What a rank publishes to the others (fixed size, a multiple of 4 bytes). */
typedef struct lf_ar_record {
  char host[64];
  int32_t device;     /* CUDA ordinal on that host */
  int32_t ok;         /* the region was allocated */
  unsigned char handle[64]; /* cudaIpcMemHandle_t */
} lf_ar_record;

typedef struct lf_ar_ipc lf_ar_ipc;

/* Allocates this rank's region on the current device (data capacity `cap` bytes per buffer)
 * and fills *rec. On failure rec->ok is 0 (and *out NULL); the caller still publishes rec.
 * timing = 1: the fused kernel times itself and lf_ar_ipc_free prints the medians (a benchmark
 * instrument: only in builds with LF_BENCH_INSTRUMENTS, ignored otherwise). */
lf_status lf_ar_ipc_prepare(size_t cap, double timeout_s, int timing, lf_ar_ipc **out,
                            lf_ar_record *rec);

/* Maps the peers' regions from the records of all ranks (recs[size]). Returns LF_OK when this
 * rank can take part; the ranks must then agree (all OK) before any call. */
lf_status lf_ar_ipc_attach(lf_ar_ipc *a, int rank, int size, const lf_ar_record *recs);

/* 1 when a call of `bytes` at buf can take this path (size, 16-byte alignment). */
int lf_ar_ipc_fits(const lf_ar_ipc *a, const void *buf, size_t bytes);

/* In place: buf[n] = sum over ranks; bf16 = 1 for bfloat16 elements, else fp32. */
lf_status lf_ar_ipc_run(lf_ar_ipc *a, void *buf, size_t n, int bf16, void *stream);

/* The fused residual all-reduce of tensor-parallel decoding (engine/cuda/tp.cu): the O and
 * down projections write their partial sums (fp32, [rows][dim]) straight into this rank's
 * staging buffer `slot` (lf_ar_ipc_stage, `cap` bytes), then one kernel per call:
 *   x[r] (+)= sum over ranks of partial[r]   (add_x = 0: x[r] = the sum; the embedding)
 *   out[out_rows ? out_rows[r] : r] = bf16(w * x[r] / sqrt(mean(x[r]^2) + eps))   (w non-NULL)
 * i.e. the all-reduce, the residual add and the next RMSNorm (the same bits as
 * kernels/rmsnorm.cu's) in one launch instead of three. Consecutive calls must use different
 * slots (see ar_ipc.cu for why that is enough). x 16-byte aligned, dim % 4 == 0. */
float *lf_ar_ipc_stage(lf_ar_ipc *a, int slot);
int lf_ar_ipc_norm_fits(const lf_ar_ipc *a, int rows, int dim);
lf_status lf_ar_ipc_residual_norm(lf_ar_ipc *a, int slot, float *x, int add_x, int rows, int dim,
                                  const float *w, float eps, void *out, size_t ld_out,
                                  const int32_t *out_rows, void *stream);

/* 1 once a call gave up waiting for a peer. */
int lf_ar_ipc_failed(const lf_ar_ipc *a);

/* device_ok = 0: leaves the device memory alone (a failed job exiting). */
void lf_ar_ipc_free(lf_ar_ipc *a, int device_ok);

#ifdef __cplusplus
}
#endif
#endif
