/*
 * What the CPU plugin's native kernels share (paged_attention.c, elementwise.c: one library, built by
 * vllm_port_cpu.native): the dtype codes the Python side passes, the error codes it maps to messages
 * (native._ERRORS, one table for the whole library), and float16 support where the compiler has it.
 */
#ifndef VLLM_PORT_CPU_NATIVE_H
#define VLLM_PORT_CPU_NATIVE_H

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

enum {
    OK = 0,
    ERR_DTYPE = 1,      /* dtype not built in (float16 without compiler support) */
    ERR_SEQ_LEN = 2,    /* seq_len < 0 or more tokens than its block-table row holds */
    ERR_BLOCK = 3,      /* a block-table entry the sequence uses is outside [0, num_blocks) */
    ERR_QUERY_LENS = 4, /* cu_seqlens_q not non-decreasing from 0, or past the query's tokens */
    ERR_MEMORY = 5,     /* scratch allocation failed */
    ERR_POSITION = 6,   /* a rotary position outside [0, max_position) of cos_sin_cache: nothing written */
    ERR_ROTARY_DIM = 7, /* cos_sin_cache's rotary_dim odd or above what the kernel holds */
    ERR_SLOT = 8,       /* a slot_mapping entry outside [-1, num_blocks * block_size): nothing written */
};

#if defined(__FLT16_MAX__)
#define HAVE_F16 1
typedef _Float16 f16_t;
#else
#define HAVE_F16 0
#endif

#endif
