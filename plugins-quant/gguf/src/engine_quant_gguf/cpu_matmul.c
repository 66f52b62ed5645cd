/* GGUF block matmul on the CPU: y[m, n] = sum_k x[m, k] * w[n, k], with w read straight from its
 * GGML blocks (Q4_0, Q4_1, Q8_0; layouts in formats.py).
 *
 * Each weight is dequantized in registers to exactly the float32 value gguf.quants gives it
 * (d * q + m and d * q are exact products of a float16 scale and a small integer, rounded once),
 * so the result differs from F.linear on the dequantized matrix only in the order of the float32
 * sums. Every weight block is read once per tile of up to 8 input rows: at decode (M of 1-8) the
 * time is the weight bytes (0.56-1.06 bytes a weight instead of float32's 4).
 *
 * Built by cpu_kernels.py with the host compiler; with AVX2+FMA+F16C the vector path, otherwise
 * the scalar one (same values, other sum order).
 */
#include <stdint.h>
#include <pthread.h>
#include <string.h>

#define Q4_0 2
#define Q4_1 3
#define Q8_0 8

static float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static int block_bytes(int qtype) {
    return qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : 0;
}

/* The 32 float32 weights of one block, in element order. */
static void dequant_block(const uint8_t *b, int qtype, float *out) {
    float d = f16_to_f32(b);
    if (qtype == Q8_0) {
        for (int i = 0; i < 32; i++) out[i] = (float)(int8_t)b[2 + i] * d;
    } else if (qtype == Q4_0) {
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)((b[2 + i] & 15) - 8);
            out[i + 16] = d * (float)((b[2 + i] >> 4) - 8);
        }
    } else {
        float m = f16_to_f32(b + 2);
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)(b[4 + i] & 15) + m;
            out[i + 16] = d * (float)(b[4 + i] >> 4) + m;
        }
    }
}

/* Dequantizes rows [n0, n1) of w into out (float32 [N, K], row-major). Returns 0, or -1 for an
 * unknown type. */
int gguf_dequantize(const uint8_t *w, int64_t n0, int64_t n1, int64_t K, int64_t row_bytes, int qtype,
                    float *out) {
    int bb = block_bytes(qtype);
    if (!bb) return -1;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t b = 0; b < K / 32; b++)
            dequant_block(w + n * row_bytes + b * bb, qtype, out + n * K + b * 32);
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 bytes_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

/* The block's 32 weights as four vectors of 8 (elements 0-7, 8-15, 16-23, 24-31). */
static inline void dequant_block_avx(const uint8_t *b, int qtype, __m256 w[4]) {
    __m256 d = _mm256_set1_ps(_cvtsh_ss((unsigned short)(b[0] | (b[1] << 8))));
    if (qtype == Q8_0) {
        __m128i lo = _mm_loadu_si128((const __m128i *)(b + 2));
        __m128i hi = _mm_loadu_si128((const __m128i *)(b + 18));
        w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d);
        w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d);
        w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d);
        w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d);
        return;
    }
    const __m128i mask = _mm_set1_epi8(15);
    __m128i qs = _mm_loadu_si128((const __m128i *)(b + (qtype == Q4_1 ? 4 : 2)));
    __m128i lo = _mm_and_si128(qs, mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
    __m256 q0 = bytes_to_ps(lo), q1 = bytes_to_ps(_mm_srli_si128(lo, 8));
    __m256 q2 = bytes_to_ps(hi), q3 = bytes_to_ps(_mm_srli_si128(hi, 8));
    if (qtype == Q4_1) { /* d * q is exact, so the fused d * q + m rounds as the unfused one does */
        __m256 m = _mm256_set1_ps(_cvtsh_ss((unsigned short)(b[2] | (b[3] << 8))));
        w[0] = _mm256_fmadd_ps(d, q0, m); w[1] = _mm256_fmadd_ps(d, q1, m);
        w[2] = _mm256_fmadd_ps(d, q2, m); w[3] = _mm256_fmadd_ps(d, q3, m);
    } else {
        __m256 eight = _mm256_set1_ps(8.0f);
        w[0] = _mm256_mul_ps(d, _mm256_sub_ps(q0, eight)); w[1] = _mm256_mul_ps(d, _mm256_sub_ps(q1, eight));
        w[2] = _mm256_mul_ps(d, _mm256_sub_ps(q2, eight)); w[3] = _mm256_mul_ps(d, _mm256_sub_ps(q3, eight));
    }
}

/* One output column n for MT input rows (MT 1-8, a constant after inlining). Each row sums in
 * the same order whatever MT is (two accumulators, blocks in order), so a row's result does not
 * depend on the batch it is in. */
static inline void column(const float *x, int64_t K, const uint8_t *row, int qtype, int bb, int MT,
                          float *y, int64_t ldy) {
    __m256 acc[8][2];
    for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    __m256 w[4];
    for (int64_t b = 0; b < K / 32; b++) {
        dequant_block_avx(row + b * bb, qtype, w);
        const float *xb = x + b * 32;
        for (int i = 0; i < MT; i++) {
            const float *xi = xb + i * K;
            acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xi), w[0], acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 8), w[1], acc[i][1]);
            acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 16), w[2], acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 24), w[3], acc[i][1]);
        }
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
}

static void tile(const float *x, int64_t K, const uint8_t *w, int64_t n0, int64_t n1, int64_t row_bytes,
                 int qtype, int bb, int MT, float *y, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        switch (MT) { /* constant MT: the compiler unrolls the row loop */
            case 1: column(x, K, row, qtype, bb, 1, y + n, ldy); break;
            case 2: column(x, K, row, qtype, bb, 2, y + n, ldy); break;
            case 3: column(x, K, row, qtype, bb, 3, y + n, ldy); break;
            case 4: column(x, K, row, qtype, bb, 4, y + n, ldy); break;
            case 5: column(x, K, row, qtype, bb, 5, y + n, ldy); break;
            case 6: column(x, K, row, qtype, bb, 6, y + n, ldy); break;
            case 7: column(x, K, row, qtype, bb, 7, y + n, ldy); break;
            default: column(x, K, row, qtype, bb, 8, y + n, ldy); break;
        }
    }
}
#else
static void tile(const float *x, int64_t K, const uint8_t *w, int64_t n0, int64_t n1, int64_t row_bytes,
                 int qtype, int bb, int MT, float *y, int64_t ldy) {
    float wb[32];
    for (int64_t n = n0; n < n1; n++) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t b = 0; b < K / 32; b++) {
            dequant_block(w + n * row_bytes + b * bb, qtype, wb);
            for (int i = 0; i < MT; i++)
                for (int j = 0; j < 32; j++) acc[i] += x[i * K + b * 32 + j] * wb[j];
        }
        for (int i = 0; i < MT; i++) y[i * ldy + n] = acc[i];
    }
}
#endif

/* y[m, n0:n1] (row stride ldy) = x[m, :] (float32 [M, K], contiguous) times rows [n0, n1) of w
 * (blocks, row_bytes a row). Returns 0, or -1 for an unknown type or K not whole blocks. */
int gguf_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t n0, int64_t n1,
                int64_t row_bytes, int qtype, float *y, int64_t ldy) {
    int bb = block_bytes(qtype);
    if (!bb || K % 32) return -1;
    for (int64_t m = 0; m < M; m += 8) {
        int mt = (int)(M - m < 8 ? M - m : 8);
        tile(x + m * K, K, w, n0, n1, row_bytes, qtype, bb, mt, y + m * ldy, ldy);
    }
    return 0;
}

struct job {
    const float *x; int64_t M, K; const uint8_t *w; int64_t n0, n1, row_bytes; int qtype; float *y; int64_t ldy;
};

static void *run_job(void *arg) {
    struct job *j = (struct job *)arg;
    gguf_matmul(j->x, j->M, j->K, j->w, j->n0, j->n1, j->row_bytes, j->qtype, j->y, j->ldy);
    return NULL;
}

/* gguf_matmul over `threads` threads, each taking a run of columns (a multiple of 8 wide); the
 * calling thread takes the first. Threads are started per call: at decode a call's work (tens of
 * microseconds at least) outweighs a thread start, and no pool spins between calls on a machine
 * whose cores other processes share. */
int gguf_matmul_threads(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t n0, int64_t n1,
                        int64_t row_bytes, int qtype, float *y, int64_t ldy, int threads) {
    if (!block_bytes(qtype) || K % 32) return -1;
    if (threads > 16) threads = 16;
    int64_t cols = n1 - n0, per = ((cols + threads - 1) / threads + 7) / 8 * 8;
    if (threads <= 1 || per >= cols) return gguf_matmul(x, M, K, w, n0, n1, row_bytes, qtype, y, ldy);
    pthread_t tid[16];
    struct job jobs[16];
    int started[16] = {0};
    for (int t = 1; t < threads; t++) {
        int64_t a = n0 + t * per, b = a + per < n1 ? a + per : n1;
        if (a >= n1) break;
        jobs[t] = (struct job){x, M, K, w, a, b, row_bytes, qtype, y, ldy};
        started[t] = pthread_create(&tid[t], NULL, run_job, &jobs[t]) == 0;
        if (!started[t]) run_job(&jobs[t]);
    }
    gguf_matmul(x, M, K, w, n0, n0 + per, row_bytes, qtype, y, ldy);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tid[t], NULL);
    return 0;
}

int gguf_vector_path(void) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}
