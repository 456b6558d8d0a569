/*
 * How fast one core reads a buffer in chunks visited in random order, with and without software prefetch
 * of whole chunks ahead, into L1 (prefetcht0) or L2 (prefetcht1): the access pattern of a paged KV cache.
 *
 *     cc -O2 -march=native -DLOCALITY=3 -o /tmp/reads dev/experiments/probe_scattered_reads.c   # into L1
 *     cc -O2 -march=native -DLOCALITY=2 -o /tmp/reads dev/experiments/probe_scattered_reads.c   # into L2
 *     /tmp/reads CHUNK_BYTES [CHUNKS_AHEAD]    # e.g. 2048 8; CHUNK_BYTES 268435456: one sequential pass
 *
 * HUGE=1 asks for transparent huge pages (madvise). Prints the best of five passes over 256 MiB.
 * Issue 30, docs/results/engine-cpu.md: on the 2-core EPYC, 2 KiB chunks read at 7-9 GB/s prefetched into
 * L1 and 13-18 GB/s into L2, where a sequential pass reads 19-30.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#ifndef LOCALITY
#define LOCALITY 3
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s CHUNK_BYTES [CHUNKS_AHEAD]\n", argv[0]);
        return 2;
    }
    const size_t total = (size_t)256 << 20;
    const size_t chunk = strtoull(argv[1], NULL, 10);
    const size_t ahead = argc > 2 ? strtoull(argv[2], NULL, 10) : 0;
    if (chunk < 64 || chunk % 64 || total % chunk) {
        fprintf(stderr, "CHUNK_BYTES must be a multiple of 64 dividing 256 MiB\n");
        return 2;
    }
    char *buf = aligned_alloc(4096, total);
    if (getenv("HUGE")) madvise(buf, total, MADV_HUGEPAGE);
    memset(buf, 1, total);
    const size_t chunks = total / chunk;
    uint32_t *order = malloc(chunks * sizeof *order);
    for (size_t i = 0; i < chunks; i++) order[i] = (uint32_t)i;
    srand(1);
    for (size_t i = chunks - 1; i > 0; i--) { /* Fisher-Yates */
        size_t j = (size_t)rand() % (i + 1);
        uint32_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    __m512 acc = _mm512_setzero_ps();
    double best = 1e30;
    for (int pass = 0; pass < 5; pass++) {
        double start = now();
        for (size_t c = 0; c < chunks; c++) {
            if (ahead && c + ahead < chunks) {
                const char *next = buf + (size_t)order[c + ahead] * chunk;
                for (size_t off = 0; off < chunk; off += 64) __builtin_prefetch(next + off, 0, LOCALITY);
            }
            const char *p = buf + (size_t)order[c] * chunk;
            for (size_t off = 0; off < chunk; off += 64) acc = _mm512_add_ps(acc, _mm512_load_ps((const float *)(p + off)));
        }
        double took = now() - start;
        best = took < best ? took : best;
    }
    float sink[16];
    _mm512_storeu_ps(sink, acc);
    printf("chunks of %zu bytes, %zu ahead, locality %d: %.1f GB/s%s\n", chunk, ahead, LOCALITY, total / best / 1e9,
           sink[0] == 12345.0f ? " " : "");
    return 0;
}
