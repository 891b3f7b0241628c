/* One-shot IPC all-reduce: see ar_ipc.h. */
#include "parallel/ar_ipc.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/cuda_launch.cuh"
#include "base/cuda_ptx.cuh"
#include "base/rmsnorm_dev.cuh"
#include "base/cuda_check.h"

namespace {

constexpr int kThreads = 512;
constexpr int kMaxBlocks = 64;
constexpr int kNormThreads = LF_NORM_NT; /* the fused residual + RMSNorm kernel */
constexpr int kNormBlocks = 128;   /* its largest grid (rows beyond it: grid-stride) */
constexpr int kNormMaxVpt = 8;     /* float4 per thread: rows up to 8192 wide */
/* Region layout:
 *   flags of the plain all-reduce: [2 buffers][kMaxBlocks][LF_AR_MAX_RANKS] uint32
 *   flags of the fused calls:      [LF_AR_SLOTS][kNormBlocks][LF_AR_MAX_RANKS] uint32
 *   call counters of the fused calls, own use only: [LF_AR_SLOTS][kNormBlocks] uint32
 *   (page-aligned) the two data buffers of the plain all-reduce, then the LF_AR_SLOTS staging
 *   buffers, `cap` bytes each. */
constexpr size_t kFlagBytes = 2 * kMaxBlocks * LF_AR_MAX_RANKS * sizeof(uint32_t);
constexpr size_t kNormFlagOffset = kFlagBytes;
constexpr size_t kNormFlagBytes = (size_t)LF_AR_SLOTS * kNormBlocks * LF_AR_MAX_RANKS * sizeof(uint32_t);
constexpr size_t kNormCtrOffset = kNormFlagOffset + kNormFlagBytes;
constexpr size_t kCtlBytes = kNormCtrOffset + (size_t)LF_AR_SLOTS * kNormBlocks * sizeof(uint32_t);
constexpr size_t kDataOffset = (kCtlBytes + 4095) / 4096 * 4096;
#ifdef LF_BENCH_INSTRUMENTS
/* LF_AR_TIMING=1 (a benchmark instrument, LF_BENCH_INSTRUMENTS builds only): block 0 of each of the first kTmRecs fused
 * calls records its row count, add_x (0: the embedding, a pass's first call), the ns from the
 * end of its PDL wait to the end of the handshake (waiting for the peers: their lateness plus
 * the flag round trip), the ns from there to the end of its rows (the reads and the norm), and
 * the ns since the end of this rank's previous fused call (the kernels in between). Layout: two
 * u64 (the previous call's end, calls seen), then the records. */
struct TmRec {
  uint32_t rows, add_x, wait, reduce, gap;
};
constexpr int kTmRecs = 16384;
constexpr size_t kTmBytes = 2 * sizeof(unsigned long long) + kTmRecs * sizeof(TmRec);
#endif

struct Params {
  char *region[LF_AR_MAX_RANKS]; /* every rank's region, mapped here (own included) */
  uint32_t *ctr;                 /* own: [0] calls made, [1] blocks done in this call */
  int *err;                      /* host-mapped */
  unsigned long long *tm;        /* LF_AR_TIMING=1 in LF_BENCH_INSTRUMENTS builds: kTmBytes (see
                                    TmRec); else NULL (kept so the kernels' arguments are the same
                                    in every build) */
  size_t cap;
  unsigned long long timeout_ns;
  int rank, size;
};

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void st_release_sys(uint32_t *p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint4 ld_volatile(const uint4 *p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ uint32_t *flag_at(char *region, uint32_t buf, int block, int from) {
  return reinterpret_cast<uint32_t *>(region) + (buf * kMaxBlocks + block) * LF_AR_MAX_RANKS + from;
}

/* One thread per peer r: raise this rank's flag `to` (in r's region) to `call`, then wait until
 * r's flag `from` (in this rank's region) reads `call`; after the timeout it raises the
 * host-mapped error flag and gives up, so the stream always drains. */
__device__ __forceinline__ void handshake(const Params &p, uint32_t *to, const uint32_t *from,
                                          uint32_t call) {
  st_release_sys(to, call);
  const unsigned long long t0 = global_ns();
  unsigned spins = 0;
  while (ld_acquire_sys(from) != call) {
    if ((++spins & 255u) == 0 && global_ns() - t0 > p.timeout_ns) {
      atomicExch_system(p.err, 1);
      break;
    }
  }
}

template <bool BF16> __device__ __forceinline__ void add_vec(float *acc, const uint4 &u) {
  if (BF16) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const float2 f = __bfloat1622float2(h[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  } else {
    const float *f = reinterpret_cast<const float *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) acc[i] += f[i];
  }
}

template <bool BF16> __device__ __forceinline__ uint4 pack_vec(const float *acc) {
  uint4 u;
  if (BF16) {
    __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  } else {
    float *f = reinterpret_cast<float *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = acc[i];
  }
  return u;
}

/* This call's number and buffer, read from the device counter (so graph replays alternate). */
__device__ __forceinline__ uint32_t next_call(const Params &p) {
  return *reinterpret_cast<volatile uint32_t *>(p.ctr) + 1;
}

/* Kernel 1: x into this rank's buffer of this call. A kernel of its own: the peers read the
 * copy only after it completed, when its stores are visible system-wide. (One kernel that
 * copied, fenced and raised the flags gave wrong sums now and then at large messages,
 * with a fence by the flag-raising thread or by every thread.) */
__global__ void __launch_bounds__(kThreads) ar_copy_kernel(Params p, const uint4 *x, size_t nvec) {
  const uint32_t buf = next_call(p) & 1u;
  uint4 *own = reinterpret_cast<uint4 *>(p.region[p.rank] + kDataOffset + buf * p.cap);
  for (size_t v = (size_t)blockIdx.x * kThreads + threadIdx.x; v < nvec;
       v += (size_t)gridDim.x * kThreads)
    own[v] = x[v];
}

/* Kernel 2: flags, wait, sum. nvec 16-byte vectors of x, block b owns the contiguous range
 * [b * per, (b + 1) * per): it raises flag b in every peer, waits for flag b of every peer,
 * then sums that range of every rank's buffer. */
template <bool BF16> __global__ void __launch_bounds__(kThreads) ar_kernel(Params p, uint4 *x,
                                                                            size_t nvec) {
  __shared__ uint32_t s_call;
  if (threadIdx.x == 0) s_call = next_call(p);
  __syncthreads();
  const uint32_t call = s_call, buf = call & 1u;
  const size_t per = (nvec + gridDim.x - 1) / gridDim.x;
  const size_t v0 = (size_t)blockIdx.x * per;
  const size_t v1 = v0 + per < nvec ? v0 + per : nvec;
  if (threadIdx.x < (unsigned)p.size) {
    const int r = (int)threadIdx.x;
    handshake(p, flag_at(p.region[r], buf, blockIdx.x, p.rank),
              flag_at(p.region[p.rank], buf, blockIdx.x, r), call);
  }
  __syncthreads();
  __threadfence_system(); /* every reading thread ordered after the flags it depends on */
  constexpr int kPer = BF16 ? 8 : 4;
  for (size_t v = v0 + threadIdx.x; v < v1; v += kThreads) {
    float acc[kPer];
#pragma unroll
    for (int i = 0; i < kPer; i++) acc[i] = 0.0f;
    uint4 u[LF_AR_MAX_RANKS]; /* every rank's vector in flight before the first add */
#pragma unroll
    for (int r = 0; r < LF_AR_MAX_RANKS; r++)
      if (r < p.size)
        u[r] = ld_volatile(reinterpret_cast<const uint4 *>(p.region[r] + kDataOffset + buf * p.cap) + v);
#pragma unroll
    for (int r = 0; r < LF_AR_MAX_RANKS; r++) /* rank order: the same bits on every rank */
      if (r < p.size) add_vec<BF16>(acc, u[r]);
    x[v] = pack_vec<BF16>(acc);
  }
  /* the last block to finish counts the call */
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(p.ctr + 1, 1u) == gridDim.x - 1) {
      p.ctr[1] = 0;
      __threadfence();
      atomicExch(p.ctr, call);
    }
  }
}

/* ---- fused: x += sum of the ranks' partials, then RMSNorm ------------------------------------
 * Every rank's partial sums for this call are in its staging buffer `slot` (written by the
 * kernels before this one on its stream). Block b of every rank raises its flag b in every
 * peer's region, waits for flag b of every peer, then owns rows b, b + grid, ...: it reads the
 * row of every rank's partials (rank order, the same bits everywhere), adds the fp32 residual
 * x, writes x back and the normed bf16 row. The flag value is the call number of (slot, block),
 * a counter only this block of this rank touches: block b of every rank takes part in exactly
 * the same calls (the grid depends only on the row count, the same on every rank), so the
 * counters move in step without any atomics. Two calls in a row never use the same slot (the
 * backend alternates O / down and gives the embedding the third), so a rank one call ahead
 * writes its next partials into a buffer no peer still reads: a rank finishes call k only once
 * every peer started it, i.e. finished call k - 1. */
struct NormArgs {
  float *x;          /* [rows][dim] residual, updated in place */
  const float *w;    /* [dim] norm weight, or NULL: no norm */
  __nv_bfloat16 *out;
  const int32_t *out_rows;
  size_t ld_out;
  float eps;
  int rows, dim, slot, add_x;
};

__device__ __forceinline__ float4 as_float4(const uint4 &u) {
  return make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z),
                     __uint_as_float(u.w));
}

/* Rank r's staging buffer `slot`, as 16-byte vectors. */
__device__ __forceinline__ const uint4 *stage_of(const Params &p, int r, int slot) {
  return reinterpret_cast<const uint4 *>(p.region[r] + kDataOffset + (2 + (size_t)slot) * p.cap);
}

/* With add_x, this rank's residual of one row: it does not depend on a peer, so it is read before
 * the handshake. */
template <int VPT>
__device__ __forceinline__ void load_x(const NormArgs &a, int row, float4 (&xo)[VPT]) {
  const int n4 = a.dim >> 2;
  const float4 *xr = reinterpret_cast<const float4 *>(a.x) + (size_t)row * n4;
#pragma unroll
  for (int j = 0; j < VPT; j++) {
    const int i = threadIdx.x + j * kNormThreads;
    xo[j] = a.add_x && i < n4 ? xr[i] : make_float4(0, 0, 0, 0);
  }
}

/* The row's vectors of every rank's staging buffer `slot`, summed in the pairwise tree
 * ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)) (rank order for 2): the tree
 * lf_cuda_gemv_parts uses over its K parts, so rank r's partial over parts [r P/T, (r+1) P/T)
 * continues it exactly and the sum equals one GPU's. NR >= p.size ranks are provided for. The
 * loads are issued in groups of up to 16 vectors before any is used: one NVLink round trip a
 * group. (One vector's loads then its adds, in turn, would cost VPT round trips a call.) */
template <int VPT, int NR>
__device__ __forceinline__ void sum_ranks(const Params &p, int slot, int row, int n4,
                                          float4 (&v)[VPT]) {
  constexpr int G = NR >= 8 ? 1 : 16 / NR, JG = G < VPT ? G : VPT; /* vectors a group */
  const size_t off4 = (size_t)row * n4;
#pragma unroll
  for (int j0 = 0; j0 < VPT; j0 += JG) {
    uint4 raw[JG][NR];
#pragma unroll
    for (int jj = 0; jj < JG; jj++) {
      const int i = threadIdx.x + (j0 + jj) * kNormThreads;
#pragma unroll
      for (int r = 0; r < NR; r++)
        if (r < p.size && i < n4) raw[jj][r] = ld_volatile(stage_of(p, r, slot) + off4 + i);
    }
#pragma unroll
    for (int jj = 0; jj < JG; jj++) {
      const int i = threadIdx.x + (j0 + jj) * kNormThreads;
      float4 f[NR];
#pragma unroll
      for (int r = 0; r < NR; r++) f[r] = as_float4(raw[jj][r]);
#pragma unroll
      for (int s = 1; s < NR; s *= 2)
#pragma unroll
        for (int r = 0; r + s < NR; r += 2 * s)
          if (r + s < p.size)
            f[r] = make_float4(f[r].x + f[r + s].x, f[r].y + f[r + s].y, f[r].z + f[r + s].z,
                               f[r].w + f[r + s].w);
      v[j0 + jj] = i < n4 ? f[0] : make_float4(0, 0, 0, 0);
    }
  }
}

template <int VPT, int NR>
__global__ void __launch_bounds__(kNormThreads) ar_norm_kernel(Params p, NormArgs a) {
  __shared__ uint32_t s_call;
  __shared__ float red[kNormThreads / 32 + 1]; /* lf_rms_scale */
  uint32_t *ctr = reinterpret_cast<uint32_t *>(p.region[p.rank] + kNormCtrOffset) +
                  a.slot * kNormBlocks + blockIdx.x;
  const int n4 = a.dim >> 2;
  float4 wv[VPT];
#pragma unroll
  for (int j = 0; j < VPT; j++) {
    const int i = threadIdx.x + j * kNormThreads;
    wv[j] = a.w && i < n4 ? reinterpret_cast<const float4 *>(a.w)[i] : make_float4(0, 0, 0, 0);
  }
  /* launched with programmatic dependent launch (base/cuda_launch.cuh): the partials come
   * from the kernel before, complete and visible only after this */
  pdl_wait();
#ifdef LF_BENCH_INSTRUMENTS
  const unsigned long long t0 = p.tm && blockIdx.x == 0 ? global_ns() : 0;
#endif
  if (threadIdx.x == 0) s_call = *reinterpret_cast<volatile uint32_t *>(ctr) + 1;
  float4 xo[VPT]; /* the first row's residual, read while the peers are awaited */
  if ((int)blockIdx.x < a.rows) load_x(a, blockIdx.x, xo);
  __syncthreads();
  const uint32_t call = s_call;
  if (threadIdx.x < (unsigned)p.size) {
    const int r = (int)threadIdx.x;
    const size_t at = ((size_t)a.slot * kNormBlocks + blockIdx.x) * LF_AR_MAX_RANKS;
    __threadfence_system(); /* the partials (earlier kernels) before the flag, for every peer */
    handshake(p, reinterpret_cast<uint32_t *>(p.region[r] + kNormFlagOffset) + at + p.rank,
              reinterpret_cast<const uint32_t *>(p.region[p.rank] + kNormFlagOffset) + at + r,
              call);
  }
  __syncthreads();
#ifdef LF_BENCH_INSTRUMENTS
  const unsigned long long t1 = p.tm && blockIdx.x == 0 ? global_ns() : 0;
#endif
  pdl_trigger(); /* the next kernel may start loading its weights */
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const size_t off = (size_t)row * a.dim; /* floats */
    if (row != (int)blockIdx.x) load_x(a, row, xo);
    float4 v[VPT];
    sum_ranks<VPT, NR>(p, a.slot, row, n4, v);
    float4 *xr = reinterpret_cast<float4 *>(a.x + off);
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < VPT; j++) {
      const int i = threadIdx.x + j * kNormThreads;
      if (i < n4) {
        if (a.add_x) {
          const float4 o = xo[j];
          v[j] = make_float4(o.x + v[j].x, o.y + v[j].y, o.z + v[j].z, o.w + v[j].w);
        }
        xr[i] = v[j];
        ss += lf_sq4(v[j]);
      }
    }
    if (!a.w) continue;
    /* the norm of kernels/rmsnorm.cu, by the same code: the same bits for the same row */
    const float rs = lf_rms_scale(ss, red, a.dim, a.eps);
    __nv_bfloat16 *o = a.out + (size_t)(a.out_rows ? a.out_rows[row] : row) * a.ld_out;
#pragma unroll
    for (int j = 0; j < VPT; j++) {
      const int i = threadIdx.x + j * kNormThreads;
      if (i < n4) lf_store_normed4(o, i, wv[j], v[j], rs);
    }
  }
  if (threadIdx.x == 0) *reinterpret_cast<volatile uint32_t *>(ctr) = call;
#ifdef LF_BENCH_INSTRUMENTS
  if (p.tm && blockIdx.x == 0 && threadIdx.x == 0) {
    const unsigned long long t2 = global_ns();
    const unsigned long long i = p.tm[1], prev = p.tm[0];
    if (i < (unsigned long long)kTmRecs) {
      TmRec r;
      r.rows = (uint32_t)a.rows;
      r.add_x = (uint32_t)a.add_x;
      r.wait = (uint32_t)min(t1 - t0, 0xffffffffull);
      r.reduce = (uint32_t)min(t2 - t1, 0xffffffffull);
      r.gap = prev && t0 > prev ? (uint32_t)min(t0 - prev, 0xffffffffull) : 0xffffffffu;
      reinterpret_cast<TmRec *>(p.tm + 2)[i] = r;
    }
    p.tm[1] = i + 1;
    p.tm[0] = t2;
  }
#endif
}

} // namespace

struct lf_ar_ipc {
  Params p;
  char *own;         /* this rank's region (cudaMalloc) */
  int opened[LF_AR_MAX_RANKS];
  int *err_host;     /* host-mapped error flag */
  int attached;
};

#ifdef LF_BENCH_INSTRUMENTS
static int cmp_double(const void *x, const void *y) {
  const double a = *(const double *)x, b = *(const double *)y;
  return a < b ? -1 : a > b;
}
static double median(double *v, int n) {
  if (n <= 0) return 0.0;
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* LF_AR_TIMING=1: ar_norm_kernel's records as passes (a pass starts at an add_x = 0 call; all
 * its calls have one row count), medians over the passes of each row count, to stderr. */
static void print_timing(const lf_ar_ipc *a) {
  unsigned long long head[2];
  TmRec *rec = (TmRec *)malloc(kTmRecs * sizeof(TmRec));
  double *col[6];
  for (int j = 0; j < 6; j++) col[j] = (double *)malloc(kTmRecs * sizeof(double));
  int ok = rec && col[0] && col[1] && col[2] && col[3] && col[4] && col[5];
  if (ok && (cudaMemcpy(head, a->p.tm, sizeof head, cudaMemcpyDeviceToHost) != cudaSuccess ||
             cudaMemcpy(rec, a->p.tm + 2, kTmRecs * sizeof(TmRec), cudaMemcpyDeviceToHost) !=
                 cudaSuccess)) {
    cudaGetLastError();
    ok = 0;
  }
  const int n = ok ? (int)(head[1] < (unsigned long long)kTmRecs ? head[1] : kTmRecs) : 0;
  /* one row count at a time; the records of a row count done are marked by rows = 0 */
  while (ok) {
    uint32_t R = 0;
    for (int i = 0; i < n && !R; i++)
      if (rec[i].add_x == 0 && rec[i].rows) R = rec[i].rows;
    if (!R) break;
    int np = 0, nw = 0;
    for (int i = 0; i < n; i++) {
      if (rec[i].add_x != 0 || rec[i].rows != R) continue;
      int j = i + 1;
      while (j < n && rec[j].add_x != 0 && rec[j].rows == R) j++;
      if (j >= n && head[1] > (unsigned long long)kTmRecs) break; /* cut short */
      double w_other = 0, red = 0, gaps = 0;
      for (int k = i + 1; k < j; k++) {
        w_other += rec[k].wait * 1e-3;
        col[5][nw++] = rec[k].wait * 1e-3;
        gaps += rec[k].gap * 1e-3;
      }
      for (int k = i; k < j; k++) red += rec[k].reduce * 1e-3;
      col[0][np] = rec[i].wait * 1e-3;
      col[1][np] = w_other;
      col[2][np] = red;
      col[3][np] = gaps;
      col[4][np] = j - i;
      np++;
      for (int k = i; k < j; k++) rec[k].rows = 0;
      i = j - 1;
    }
    for (int i = 0; i < n; i++)
      if (rec[i].rows == R && rec[i].add_x == 0) rec[i].rows = 0;
    if (!np) continue;
    const int calls = (int)median(col[4], np);
    fprintf(stderr,
            "LF_AR_TIMING rank %d/%d rows %u: %d passes of %d calls, medians of a pass (us): "
            "first call's wait %.2f, the other calls' waits %.2f (a call's median %.2f), "
            "reduce+norm %.2f, between calls %.2f\n",
            a->p.rank, a->p.size, R, np, calls, median(col[0], np), median(col[1], np),
            median(col[5], nw), median(col[2], np), median(col[3], np));
  }
  free(rec);
  for (int j = 0; j < 6; j++) free(col[j]);
}
#endif

extern "C" lf_status lf_ar_ipc_prepare(size_t cap, double timeout_s, int timing,
                                       lf_ar_ipc **out, lf_ar_record *rec) {
  memset(rec, 0, sizeof *rec);
  *out = NULL;
  gethostname(rec->host, sizeof rec->host - 1);
  cudaGetDevice(&rec->device);
  cap = (cap + 4095) / 4096 * 4096;
  lf_ar_ipc *a = (lf_ar_ipc *)calloc(1, sizeof *a);
  if (!a) return lf_error(LF_ERR_OUT_OF_MEMORY, "IPC all-reduce");
  a->p.cap = cap;
  a->p.timeout_ns = (unsigned long long)(timeout_s * 1e9);
  cudaError_t e = cudaMalloc((void **)&a->own, kDataOffset + (2 + LF_AR_SLOTS) * cap);
  if (e == cudaSuccess) e = cudaMemset(a->own, 0, kCtlBytes);
  if (e == cudaSuccess) e = cudaMalloc((void **)&a->p.ctr, 2 * sizeof(uint32_t));
  if (e == cudaSuccess) e = cudaMemset(a->p.ctr, 0, 2 * sizeof(uint32_t));
#ifdef LF_BENCH_INSTRUMENTS
  if (e == cudaSuccess && timing) {
    e = cudaMalloc((void **)&a->p.tm, kTmBytes);
    if (e == cudaSuccess) e = cudaMemset(a->p.tm, 0, kTmBytes);
  }
#else
  (void)timing;
#endif
  if (e == cudaSuccess) e = cudaHostAlloc((void **)&a->err_host, sizeof(int), cudaHostAllocMapped);
  if (e == cudaSuccess) {
    *a->err_host = 0;
    e = cudaHostGetDevicePointer((void **)&a->p.err, a->err_host, 0);
  }
  cudaIpcMemHandle_t h;
  if (e == cudaSuccess) e = cudaIpcGetMemHandle(&h, a->own);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    cudaGetLastError();
    lf_ar_ipc_free(a, 1);
    return lf_error(LF_ERR_BACKEND, "IPC all-reduce: %s", cudaGetErrorString(e));
  }
  static_assert(sizeof h <= sizeof rec->handle, "cudaIpcMemHandle_t size");
  memcpy(rec->handle, &h, sizeof h);
  rec->ok = 1;
  *out = a;
  return LF_OK;
}

extern "C" lf_status lf_ar_ipc_attach(lf_ar_ipc *a, int rank, int size, const lf_ar_record *recs) {
  if (!a || size < 2 || size > LF_AR_MAX_RANKS || rank < 0 || rank >= size)
    return lf_error(LF_ERR_UNSUPPORTED, "IPC all-reduce: %d ranks (2..%d)", size, LF_AR_MAX_RANKS);
  for (int r = 0; r < size; r++) {
    if (!recs[r].ok) return lf_error(LF_ERR_UNAVAILABLE, "IPC all-reduce: rank %d has no region", r);
    if (strncmp(recs[r].host, recs[rank].host, sizeof recs[r].host))
      return lf_error(LF_ERR_UNSUPPORTED, "IPC all-reduce: ranks on several hosts");
    if (r == rank) continue;
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, recs[rank].device, recs[r].device) != cudaSuccess || !can) {
      cudaGetLastError();
      return lf_error(LF_ERR_UNSUPPORTED, "IPC all-reduce: GPU %d cannot access GPU %d",
                      recs[rank].device, recs[r].device);
    }
  }
  a->p.rank = rank;
  a->p.size = size;
  for (int r = 0; r < size; r++) {
    if (r == rank) {
      a->p.region[r] = a->own;
      continue;
    }
    cudaIpcMemHandle_t h;
    memcpy(&h, recs[r].handle, sizeof h);
    void *ptr = NULL;
    const cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return lf_error(LF_ERR_UNAVAILABLE, "IPC all-reduce: opening rank %d's memory: %s", r,
                      cudaGetErrorString(e));
    }
    a->p.region[r] = (char *)ptr;
    a->opened[r] = 1;
  }
  a->attached = 1;
  return LF_OK;
}

extern "C" int lf_ar_ipc_fits(const lf_ar_ipc *a, const void *buf, size_t bytes) {
  return a && a->attached && bytes > 0 && bytes <= a->p.cap && bytes % 16 == 0 &&
         ((uintptr_t)buf & 15) == 0;
}

extern "C" lf_status lf_ar_ipc_run(lf_ar_ipc *a, void *buf, size_t n, int bf16, void *stream) {
  const size_t bytes = n * (bf16 ? 2 : 4);
  if (!lf_ar_ipc_fits(a, buf, bytes))
    return lf_error(LF_ERR_INTERNAL, "IPC all-reduce: %zu bytes do not fit", bytes);
  const size_t nvec = bytes / 16;
  /* ~2 vectors per thread: one block up to 16 KB, 64 blocks from 1 MB */
  size_t blocks = (nvec + 2 * kThreads - 1) / (2 * kThreads);
  if (blocks > (size_t)kMaxBlocks) blocks = kMaxBlocks;
  if (blocks < 1) blocks = 1;
  cudaStream_t st = (cudaStream_t)stream;
  size_t cblocks = (nvec + 4 * kThreads - 1) / (4 * kThreads);
  if (cblocks > 132) cblocks = 132;
  if (cblocks < 1) cblocks = 1;
  ar_copy_kernel<<<(unsigned)cblocks, kThreads, 0, st>>>(a->p, (const uint4 *)buf, nvec);
  if (bf16)
    ar_kernel<true><<<(unsigned)blocks, kThreads, 0, st>>>(a->p, (uint4 *)buf, nvec);
  else
    ar_kernel<false><<<(unsigned)blocks, kThreads, 0, st>>>(a->p, (uint4 *)buf, nvec);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return lf_error(LF_ERR_BACKEND, "IPC all-reduce launch: %s", cudaGetErrorString(e));
  return LF_OK;
}

extern "C" float *lf_ar_ipc_stage(lf_ar_ipc *a, int slot) {
  if (!a || !a->attached || slot < 0 || slot >= LF_AR_SLOTS) return NULL;
  return reinterpret_cast<float *>(a->own + kDataOffset + (2 + (size_t)slot) * a->p.cap);
}

extern "C" int lf_ar_ipc_norm_fits(const lf_ar_ipc *a, int rows, int dim) {
  return a && a->attached && rows >= 1 && dim >= 4 && dim % 4 == 0 &&
         dim / 4 <= kNormThreads * kNormMaxVpt && (size_t)rows * dim * sizeof(float) <= a->p.cap;
}

extern "C" lf_status lf_ar_ipc_residual_norm(lf_ar_ipc *a, int slot, float *x, int add_x, int rows,
                                             int dim, const float *w, float eps, void *out,
                                             size_t ld_out, const int32_t *out_rows,
                                             void *stream) {
  if (!lf_ar_ipc_norm_fits(a, rows, dim) || slot < 0 || slot >= LF_AR_SLOTS || !x ||
      ((uintptr_t)x & 15) || (w && (((uintptr_t)w & 15) || !out || ((uintptr_t)out & 7) ||
                                   ld_out % 4)))
    return lf_error(LF_ERR_INTERNAL, "IPC residual all-reduce: %d rows of %d do not fit", rows,
                    dim);
  NormArgs na;
  na.x = x;
  na.w = w;
  na.out = (__nv_bfloat16 *)out;
  na.out_rows = out_rows;
  na.ld_out = ld_out;
  na.eps = eps;
  na.rows = rows;
  na.dim = dim;
  na.slot = slot;
  na.add_x = add_x;
  const unsigned grid = (unsigned)(rows < kNormBlocks ? rows : kNormBlocks);
  const int vpt = (dim / 4 + kNormThreads - 1) / kNormThreads;
  cudaStream_t st = (cudaStream_t)stream;
  const dim3 g(grid), b(kNormThreads);
  const int nr = a->p.size <= 2 ? 2 : a->p.size <= 4 ? 4 : 8;
  cudaError_t e;
#define AR_NORM_LAUNCH(V, R) e = lf_launch(ar_norm_kernel<V, R>, g, b, 0, st, a->p, na)
#define AR_NORM_BY_RANKS(V)                                                                       \
  do {                                                                                            \
    if (nr == 2) AR_NORM_LAUNCH(V, 2);                                                            \
    else if (nr == 4) AR_NORM_LAUNCH(V, 4);                                                       \
    else AR_NORM_LAUNCH(V, 8);                                                                    \
  } while (0)
  if (vpt <= 1)
    AR_NORM_BY_RANKS(1);
  else if (vpt <= 2)
    AR_NORM_BY_RANKS(2);
  else if (vpt <= 4)
    AR_NORM_BY_RANKS(4);
  else
    AR_NORM_BY_RANKS(8);
#undef AR_NORM_BY_RANKS
#undef AR_NORM_LAUNCH
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess)
    return lf_error(LF_ERR_BACKEND, "IPC residual all-reduce launch: %s", cudaGetErrorString(e));
  return LF_OK;
}

extern "C" int lf_ar_ipc_failed(const lf_ar_ipc *a) {
  return a && a->err_host && *(volatile int *)a->err_host != 0;
}

extern "C" void lf_ar_ipc_free(lf_ar_ipc *a, int device_ok) {
  if (!a) return;
  if (device_ok) {
#ifdef LF_BENCH_INSTRUMENTS
    if (a->p.tm && a->attached && cudaDeviceSynchronize() == cudaSuccess) print_timing(a);
    if (a->p.tm) cudaFree(a->p.tm);
#endif
    for (int r = 0; r < LF_AR_MAX_RANKS; r++)
      if (a->opened[r]) cudaIpcCloseMemHandle(a->p.region[r]);
    cudaFree(a->own);
    cudaFree(a->p.ctr);
    if (a->err_host) cudaFreeHost(a->err_host);
  }
  free(a);
}
