/* The process-wide launch settings of base/cuda_launch.cuh. */
#include "base/cuda_launch.cuh"

int lf_pdl_allowed = 1;
thread_local int lf_pdl_pass_off = 0;
