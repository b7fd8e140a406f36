/* Fused CPU kernels: one pass over the rows where PyTorch's eager ops take several.
 *
 * Built by astrai_pl/ops/cpu.py with the host C compiler (-O3 -march=native -fopenmp) into a small
 * shared library called through ctypes: no PyTorch headers, a second of compiling. OpenMP resolves
 * to the runtime PyTorch has already loaded (same soname), so both share one thread pool.
 *
 * Every tensor is float32, contiguous, rows x dim. Sums are taken in float, as PyTorch's CPU mean is.
 */
#define _GNU_SOURCE /* syscall, clock_gettime */
#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- a barrier that spins briefly, then sleeps ----------------------------------------------------------
 * The threads of a region meet between the phases of a fused layer (the q/k/v projection must be complete
 * before attention reads it). OpenMP's own barrier follows OMP_WAIT_POLICY, and the package sets PASSIVE
 * (spinning threads took the cores the stepping thread needed on a shared machine, docs/serving.md): every
 * waiter then sleeps in the kernel at once, and waking it costs 30-90 us on a virtual machine — more than a
 * phase of a decode step at the `small` preset takes. This one spins up to BARRIER_SPIN_NS first (the phases
 * are balanced, so the others usually arrive within a few microseconds), then sleeps on a futex. A waiter
 * whose partner lost its core to another process stops spinning after that, so the core it holds goes idle
 * and the scheduler can move the partner there — what spinning without bound prevents. */
#ifndef BARRIER_SPIN_NS
#define BARRIER_SPIN_NS 50000L
#endif

struct team_barrier {
    atomic_int arrived, sleepers;
    atomic_uint generation;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void team_barrier_wait(struct team_barrier *b, int threads) {
    if (threads <= 1) return;
    const unsigned generation = atomic_load(&b->generation);
    if (atomic_fetch_add(&b->arrived, 1) == threads - 1) { /* the last one in lets the others go */
        atomic_store(&b->arrived, 0);
        atomic_fetch_add(&b->generation, 1);
#if defined(__linux__)
        if (atomic_load(&b->sleepers) > 0) syscall(SYS_futex, &b->generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
        return;
    }
    const long deadline = now_ns() + BARRIER_SPIN_NS;
    for (long spins = 1;; ++spins) {
        if (atomic_load_explicit(&b->generation, memory_order_acquire) != generation) return;
        cpu_relax();
        if (spins % 64 == 0 && now_ns() > deadline) break;
    }
    /* sleepers is raised before the generation is read again in the kernel, and the last one in raises the
     * generation before it reads sleepers (both sequentially consistent): one of the two sees the other */
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->generation) == generation) {
#if defined(__linux__)
        syscall(SYS_futex, &b->generation, FUTEX_WAIT_PRIVATE, generation, NULL, NULL, 0);
#else /* no futex: sleep in short naps */
        const struct timespec nap = {0, 20000};
        nanosleep(&nap, NULL);
#endif
    }
    atomic_fetch_sub(&b->sleepers, 1);
}

/* One row; returns its rstd. Not inlined: the fused decode layer calls the same code, so its rows come out
 * bit for bit as this kernel's. */
__attribute__((noinline)) static float rms_norm_row(const float *xr, const float *w, float *yr, long dim, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (long i = 0; i < dim; ++i) ss += xr[i] * xr[i];
    const float s = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (long i = 0; i < dim; ++i) yr[i] = xr[i] * s * w[i];
    return s;
}

/* y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) per row; rstd is kept for the backward. */
void rms_norm_forward(const float *x, const float *w, float *y, float *rstd, long rows, long dim, float eps,
                      int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; ++r) rstd[r] = rms_norm_row(x + r * dim, w, y + r * dim, dim, eps);
}

/* gx = rstd * (g*w - xhat * mean(g*w*xhat)) with xhat = x * rstd; gw_parts[t] = sum over thread t's rows
 * of g * xhat (the caller sums the `threads` rows of gw_parts). */
void rms_norm_backward(const float *x, const float *w, const float *rstd, const float *g, float *gx,
                       float *gw_parts, long rows, long dim, int threads) {
    memset(gw_parts, 0, sizeof(float) * (size_t)threads * (size_t)dim);
#pragma omp parallel num_threads(threads)
    {
        float *gw = gw_parts + (long)omp_get_thread_num() * dim;
#pragma omp for schedule(static)
        for (long r = 0; r < rows; ++r) {
            const float *xr = x + r * dim, *gr = g + r * dim;
            float *gxr = gx + r * dim;
            const float s = rstd[r];
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (long i = 0; i < dim; ++i) dot += gr[i] * w[i] * xr[i];
            const float c = dot * s * s / (float)dim; /* mean(g*w*xhat) / rstd */
#pragma omp simd
            for (long i = 0; i < dim; ++i) {
                gxr[i] = s * (gr[i] * w[i] - xr[i] * c);
                gw[i] += gr[i] * xr[i] * s;
            }
        }
    }
}

/* One row's heads (x_row's heads `dim` apart, out_row dense). Not inlined: the fused decode layer calls the same
 * code (see rms_norm_row). */
__attribute__((noinline)) static void rotary_row(const float *x_row, const float *c, const float *s, float *out_row,
                                                 long heads, long dim, int backward) {
    const long half = dim / 2;
    for (long h = 0; h < heads; ++h) {
        const float *xr = x_row + h * dim;
        float *o = out_row + h * dim;
        if (backward) {
#pragma omp simd
            for (long i = 0; i < half; ++i) {
                o[i] = xr[i] * c[i] + xr[i + half] * s[i + half];
                o[i + half] = xr[i + half] * c[i + half] - xr[i] * s[i];
            }
        } else {
#pragma omp simd
            for (long i = 0; i < half; ++i) {
                o[i] = xr[i] * c[i] - xr[i + half] * s[i];
                o[i + half] = xr[i + half] * c[i + half] + xr[i] * s[i + half];
            }
        }
    }
}

/* Rotary embedding in the rotate-half layout, on x (rows, heads, dim) with cos/sin (rows, dim):
 *   forward   out = x * cos + rotate_half(x) * sin,      rotate_half(x) = [-x2, x1]
 *   backward  out = x * cos + rotate_half^T(x * sin),    rotate_half^T(z) = [z2, -z1]
 * (the backward of a rotation is the rotation back). `x_stride` is the distance between rows of x. */
void rotary(const float *x, long x_stride, const float *cos, const float *sin, float *out, long rows, long heads,
            long dim, int backward, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; ++r)
        rotary_row(x + r * x_stride, cos + r * dim, sin + r * dim, out + r * heads * dim, heads, dim, backward);
}

/* ---- matmul of a few rows against a weight packed in 64-column panels -------------------------------
 * y (M, N) = x (M, K) @ W^T for W (N, K), with W packed as panels (ceil(N/64), K, 64): panel p holds
 * columns 64p…64p+63, each k a contiguous run of 64 floats, so a panel is read as one stream. A tile of
 * R rows x W columns lives in registers while k runs: with AVX-512 up to 6 rows x all 64 columns (24 of
 * its 32 registers); with AVX2 (16 registers) 1 x 64, 2 x 32 or up to 6 x 16 (at most 12 accumulators:
 * a wider tile spills every step), the strips of a panel in turn. A panel is taken K_BLOCK k steps at a
 * time (32 KB): every row block and strip runs over that block while it sits in L1, the tiles carrying
 * their sums from one block to the next through y (the same additions in the same order), and while they
 * do, each prefetches its share of the next block into L2 (one group every four k steps), so the weights stream
 * from memory behind the arithmetic instead of ahead of it. Row blocks re-reading a whole panel from L2
 * instead (a down projection's panel of K = 1408 is 360 KB, most of L2 with the next one coming in) cost
 * the 16 rows of a decode step at the `small` preset a fifth more time; blocks of 128 k steps instead of 64
 * (half the trips of each tile's sums through y) made a whole decode step 3-6% faster on a Zen 4 core (32 KB
 * of L1; in-process A/B of the two builds at `small` and at the SmolLM2-135M shape). With the few rows of a
 * decode step this is bound by reading the weights, which is what it is built to do fast. */
#define PANEL 64
#define TILE_ROWS 6
#ifndef K_BLOCK
#define K_BLOCK 128
#endif
#if defined(__AVX512F__)
#define VEC 16
#else
#define VEC 8
#endif
typedef float vec __attribute__((vector_size(VEC * 4), aligned(4)));

/* one k step of a tile: acc[m][·] += x[m, kk] · the panel's row at `wk` */
#define TILE_STEP(R, V, wk, kk)                                                                          \
    {                                                                                                     \
        vec b[V];                                                                                         \
        _Pragma("GCC unroll 8") for (int j = 0; j < V; ++j) b[j] = *(const vec *)((wk) + j * VEC);        \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) {                                             \
            const float a = x[m * ldx + (kk)];                                                            \
            _Pragma("GCC unroll 8") for (int j = 0; j < V; ++j) acc[m][j] += a * b[j];                    \
        }                                                                                                 \
    }

#define DEFINE_TILE(R, W)                                                                                \
    static void tile##R##_##W(const float *x, long ldx, const float *wp, float *y, long ldy, long K,      \
                              long cols, const char *pf, long pf_lines, int add) {                    \
        enum { V = W / VEC };                                                                             \
        vec acc[R][V];                                                                                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) {                                             \
            if (add && cols == W) {                                                                       \
                memcpy(acc[m], y + m * ldy, sizeof(acc[m]));                                              \
            } else if (add) {                                                                             \
                float first[W] = {0};                                                                     \
                memcpy(first, y + m * ldy, sizeof(float) * cols);                                        \
                memcpy(acc[m], first, sizeof(acc[m]));                                                    \
            } else {                                                                                      \
                _Pragma("GCC unroll 8") for (int j = 0; j < V; ++j) acc[m][j] = (vec){0};                 \
            }                                                                                             \
        }                                                                                                 \
        /* k in fours, the prefetches of `pf` spread one group per four steps (fewer loop instructions per \
         * FMA than one check per step: 10% more speed for the 16 rows of a decode step), then the rest */ \
        const long fours = (K + 3) / 4, per_four = (pf_lines + fours - 1) / fours;                      \
        long line = 0, k = 0;                                                                             \
        for (; k + 4 <= K; k += 4, wp += 4 * PANEL) {                                                     \
            for (long end = line + per_four < pf_lines ? line + per_four : pf_lines; line < end; ++line)  \
                __builtin_prefetch(pf + line * 64, 0, 2);                                                 \
            _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u) TILE_STEP(R, V, wp + u * PANEL, k + u)    \
        }                                                                                                 \
        for (; line < pf_lines; ++line) __builtin_prefetch(pf + line * 64, 0, 2);                         \
        for (; k < K; ++k, wp += PANEL) TILE_STEP(R, V, wp, k)                                            \
        /* constant-size stores only: a variable-size copy out of acc would keep it in memory, not registers */ \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) {                                             \
            if (cols == W) {                                                                              \
                memcpy(y + m * ldy, acc[m], sizeof(acc[m]));                                              \
            } else {                                                                                      \
                float last[W];                                                                            \
                memcpy(last, acc[m], sizeof(last));                                                       \
                memcpy(y + m * ldy, last, sizeof(float) * cols);                                          \
            }                                                                                             \
        }                                                                                                 \
    }
typedef void (*tile_fn)(const float *, long, const float *, float *, long, long, long, const char *, long, int);
#if defined(__AVX512F__)
DEFINE_TILE(1, 64) DEFINE_TILE(2, 64) DEFINE_TILE(3, 64) DEFINE_TILE(4, 64) DEFINE_TILE(5, 64) DEFINE_TILE(6, 64)
static const tile_fn TILES[TILE_ROWS + 1] = {0, tile1_64, tile2_64, tile3_64, tile4_64, tile5_64, tile6_64};
static const long TILE_WIDTH[TILE_ROWS + 1] = {0, 64, 64, 64, 64, 64, 64};
#else
DEFINE_TILE(1, 64) DEFINE_TILE(2, 32) DEFINE_TILE(3, 16) DEFINE_TILE(4, 16) DEFINE_TILE(5, 16) DEFINE_TILE(6, 16)
static const tile_fn TILES[TILE_ROWS + 1] = {0, tile1_64, tile2_32, tile3_16, tile4_16, tile5_16, tile6_16};
static const long TILE_WIDTH[TILE_ROWS + 1] = {0, 64, 32, 16, 16, 16, 16};
#endif

/* The work of panel_matmul, shared out among the threads of the parallel region it is called from (every
 * thread calls it; they meet at the end). */
static void panel_matmul_shared(const float *x, long ldx, const float *panels, float *y, long M, long K, long N) {
    const long num_panels = (N + PANEL - 1) / PANEL, panel_size = (long)PANEL * K;
    const long passes = (M + TILE_ROWS - 1) / TILE_ROWS;
    /* Runs of panels handed out as threads ask (a thread whose core is busy with another process takes
     * fewer), each long enough that the next panel a thread prefetches is mostly its own. */
    const long threads = omp_get_num_threads();
    const long run = num_panels / (8L * threads) > 1 ? num_panels / (8L * threads) : 1;
#pragma omp for schedule(dynamic, run) nowait
    for (long p = 0; p < num_panels; ++p) {
        const float *wp = panels + p * panel_size;
        const long width = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
        for (long k0 = 0; k0 < K; k0 += K_BLOCK) {
            const long kb = K - k0 < K_BLOCK ? K - k0 : K_BLOCK;
            /* what this block prefetches: the panel's next k-block, or the next panel's first one */
            const int last = k0 + kb >= K && p + 1 == num_panels;
            const float *next = k0 + kb < K ? wp + (k0 + kb) * PANEL : wp + panel_size;
            const long next_kb = k0 + kb < K ? (K - k0 - kb < K_BLOCK ? K - k0 - kb : K_BLOCK) : (K < K_BLOCK ? K : K_BLOCK);
            const long lines = last ? 0 : next_kb * PANEL * (long)sizeof(float) / 64;
            const long block_share = (lines + passes - 1) / passes; /* lines each row block prefetches */
            for (long pass = 0, m0 = 0; m0 < M; m0 += TILE_ROWS, ++pass) {
                const long rows = M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS, strip = TILE_WIDTH[rows];
                const long block_end = (pass + 1) * block_share < lines ? (pass + 1) * block_share : lines;
                const long share = (block_share + PANEL / strip - 1) / (PANEL / strip); /* per strip, over its k steps */
                for (long c0 = 0; c0 < width; c0 += strip) {
                    const long first = pass * block_share + (c0 / strip) * share;
                    const long todo = first >= block_end ? 0 : (block_end - first < share ? block_end - first : share);
                    const long cols = width - c0 < strip ? width - c0 : strip;
                    TILES[rows](x + m0 * ldx + k0, ldx, wp + k0 * PANEL + c0, y + m0 * N + p * PANEL + c0, N, kb, cols,
                                (const char *)next + first * 64, todo, k0 > 0);
                }
            }
        }
    }
}

void panel_matmul(const float *x, long ldx, const float *panels, float *y, long M, long K, long N, int threads) {
    if (M <= 0 || K <= 0 || N <= 0) return;
#pragma omp parallel num_threads(threads)
    panel_matmul_shared(x, ldx, panels, y, M, K, N);
}

/* Write W (rows, K) into the panels as their columns col0…col0+rows-1 (joined weights go side by side). */
void pack_panels(const float *w, long rows, long K, float *panels, long col0, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; ++r) {
        const long c = col0 + r;
        float *dst = panels + (c / PANEL) * (long)PANEL * K + c % PANEL;
        const float *src = w + r * K;
        for (long k = 0; k < K; ++k) dst[k * PANEL] = src[k];
    }
}

/* ---- SwiGLU's activation: silu(gate) * up ----------------------------------------------------------- */

/* e^x in float32 that vectorizes: x = n·ln2 + f with |f| <= ln2/2, e^f by its degree-7 series (Cephes'
 * coefficients), 2^n put into the exponent bits. Relative error below 1e-7 for -87 < x < 88; clamped
 * outside (e^-87 ~ 1.6e-38, the smallest normal float's order). */
#pragma omp declare simd
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x / ln2) */
    const float f = (x - n * 0.693359375f) + n * 2.12194440e-4f;            /* x - n·ln2, in two parts */
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* One row (see rms_norm_row for why not inlined). */
__attribute__((noinline)) static void swiglu_row(const float *g, const float *u, float *o, long cols) {
#pragma omp simd
    for (long i = 0; i < cols; ++i) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
}

/* out (rows, cols) = gate * sigmoid(gate) * up; gate and up rows `g_stride` / `u_stride` floats apart. */
void swiglu_forward(const float *gate, long g_stride, const float *up, long u_stride, float *out, long rows,
                    long cols, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; ++r) swiglu_row(gate + r * g_stride, up + r * u_stride, out + r * cols, cols);
}

/* d_gate = d·up·s·(1 + gate·(1 - s)), d_up = d·gate·s with s = sigmoid(gate); every tensor (rows, cols)
 * contiguous. */
void swiglu_backward(const float *gate, const float *up, const float *grad, float *d_gate, float *d_up,
                     long rows, long cols, int threads) {
    const long n = rows * cols;
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (long i = 0; i < n; ++i) {
        const float g = gate[i], s = 1.0f / (1.0f + exp_approx(-g)), d = grad[i];
        d_up[i] = d * g * s;
        d_gate[i] = d * up[i] * s * (1.0f + g * (1.0f - s));
    }
}

/* ---- decode attention straight from a paged KV pool -------------------------------------------------
 * One query token per request: out (n, hq, dim) = softmax(q·Kᵀ·scale)·V over the request's first
 * kv_lens[i] positions, whose slots are table[rows[i]·table_stride + t] in pools (slots, hkv, dim); dim a
 * multiple of 8. Query heads h·G … h·G+G-1 (G = hq / hkv) share kv head h. Nothing is gathered: each
 * (kv head, request) item reads its keys and values where they lie. Scores go to a per-thread buffer, 8
 * keys at a time: each key's 8 dot-product lanes in their own register, then summed across lanes
 * together (one horizontal add tree for 8 keys); then exp, and the weighted sum of V with each query's
 * output row held in registers. Items are handed out as threads ask (a thread whose core another process
 * shares takes fewer), kv head by kv head and requests in order, so requests that share prefix pages (a
 * common system prompt) read them from cache after the first ones. */
typedef float vec8 __attribute__((vector_size(32), aligned(4)));

/* The 8 sums of the lanes of a[0] … a[7]. */
static inline vec8 lane_sums8(const vec8 *a) {
#if defined(__AVX__)
    const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return (vec8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    vec8 out;
    for (int j = 0; j < 8; ++j) {
        float sum = 0.0f;
        for (int l = 0; l < 8; ++l) sum += a[j][l];
        out[j] = sum;
    }
    return out;
#endif
}

/* scores[g·stride + t] = scale · q_g·k_t for the G queries at q (G, dim) and keys t < L of kv head h. While it
 * scores a key it asks for that key's value row in v_pool (kv head h) to come into L2: the values pass that follows
 * then finds them there instead of waiting on memory for each. Asking for them in L1 instead, or for the keys ahead
 * as well, was slower; with the values alone the decode attention over 16 requests of 80-264 keys, every layer in
 * turn, took 0.74-0.81x the time at the SmolLM2-135M shape's heads (9 on 3, 30 layers) and 0.85-0.89x at `small`'s
 * (8 on 2, 8 layers) on a Zen 4 machine (in-process A/B of the two builds, 30 interleaved rounds, two runs each). */
static void decode_scores(const float *q, long G, const float *k_pool, const float *v_pool, const int32_t *slots,
                          long L, long hkv, long h, long dim, float scale, float *scores, long stride) {
    const long chunks = dim / 8;
    for (long t0 = 0; t0 < L; t0 += 8) {
        for (long t = t0; t < t0 + 8 && t < L; ++t) {
            const char *vt = (const char *)(v_pool + ((long)slots[t] * hkv + h) * dim);
            for (long c = 0; c < dim * (long)sizeof(float); c += 64) __builtin_prefetch(vt + c, 0, 2);
        }
        const float *k[8];
        for (int j = 0; j < 8; ++j) /* past the end: the last key again, its score dropped */
            k[j] = k_pool + ((long)slots[t0 + j < L ? t0 + j : L - 1] * hkv + h) * dim;
        for (long g = 0; g < G; ++g) {
            const float *qg = q + g * dim;
            vec8 acc[8] = {{0}};
            for (long c = 0; c < chunks; ++c) {
                const vec8 qc = *(const vec8 *)(qg + 8 * c);
                _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) acc[j] += qc * *(const vec8 *)(k[j] + 8 * c);
            }
            const vec8 s = lane_sums8(acc) * scale;
            float *out = scores + g * stride + t0;
            if (t0 + 8 <= L) {
                memcpy(out, &s, sizeof s);
            } else {
                for (long j = 0; j < L - t0; ++j) out[j] = s[j];
            }
        }
    }
}

/* s[0…L) = softmax(s[0…L)). */
static void softmax_in_place(float *s, long L) {
    float mx = s[0], sum = 0.0f;
    for (long t = 1; t < L; ++t) mx = s[t] > mx ? s[t] : mx;
#pragma omp simd reduction(+ : sum)
    for (long t = 0; t < L; ++t) {
        s[t] = exp_approx(s[t] - mx);
        sum += s[t];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (long t = 0; t < L; ++t) s[t] *= inv;
}

/* acc[0…8) += Σ_{t0 <= t < t1} p[t] · columns c0…c0+63 of v_t (kv head h) */
static inline void values_64(vec8 *acc, const float *p, const float *v_pool, const int32_t *slots, long t0, long t1,
                             long hkv, long h, long dim, long c0) {
    for (long t = t0; t < t1; ++t) {
        const float *vp = v_pool + ((long)slots[t] * hkv + h) * dim + c0;
        const float w = p[t];
        _Pragma("GCC unroll 8") for (int c = 0; c < 8; ++c) acc[c] += w * *(const vec8 *)(vp + 8 * c);
    }
}

/* out (dim,) = Σ_t p[t] · v_t over keys t < L of kv head h; 8 columns of out in registers at a time. */
static void decode_values(const float *p, const float *v_pool, const int32_t *slots, long L, long hkv, long h,
                          long dim, float *out) {
    for (long c0 = 0; c0 < dim; c0 += 64) {
        const long width = dim - c0 < 64 ? (dim - c0) / 8 : 8;
        vec8 acc[8] = {{0}};
        if (width == 8) { /* all 64 columns: straight-line FMAs (a check per column cost a branch per FMA) */
            values_64(acc, p, v_pool, slots, 0, L, hkv, h, dim, c0);
        } else {
            for (long t = 0; t < L; ++t) {
                const float *vp = v_pool + ((long)slots[t] * hkv + h) * dim + c0;
                const float w = p[t];
                for (long c = 0; c < width; ++c) acc[c] += w * *(const vec8 *)(vp + 8 * c);
            }
        }
        for (long c = 0; c < width; ++c) memcpy(out + c0 + 8 * c, &acc[c], sizeof(vec8));
    }
}

/* out (G, dim) = decode_values of the G query heads of one kv head (their probabilities G rows `stride` apart).
 * With 64 columns the keys go in blocks of V_BLOCK, every head's sums carried through `out` from block to block
 * (the same additions in the same order): a block's values, read from L2 for the first head, come from L1 for
 * the others — head by head over all the keys, each head read every value from L2 again, at twice the bytes per
 * cycle L2 gives. */
#define V_BLOCK 16
static void decode_values_heads(const float *p, long G, long stride, const float *v_pool, const int32_t *slots, long L,
                                long hkv, long h, long dim, float *out) {
    if (dim != 64) {
        for (long g = 0; g < G; ++g) decode_values(p + g * stride, v_pool, slots, L, hkv, h, dim, out + g * dim);
        return;
    }
    for (long t0 = 0; t0 < L; t0 += V_BLOCK) {
        const long t1 = L - t0 < V_BLOCK ? L : t0 + V_BLOCK;
        for (long g = 0; g < G; ++g) {
            float *o = out + g * 64;
            const float *pg = p + g * stride;
            vec8 acc[8];
            _Pragma("GCC unroll 8") for (int c = 0; c < 8; ++c) acc[c] = t0 ? *(const vec8 *)(o + 8 * c) : (vec8){0};
            values_64(acc, pg, v_pool, slots, t0, t1, hkv, h, 64, 0);
            _Pragma("GCC unroll 8") for (int c = 0; c < 8; ++c) *(vec8 *)(o + 8 * c) = acc[c];
        }
    }
}

/* s[0…L) = cap · tanh(s / cap), tanh(x) = 1 - 2 / (e^{2x} + 1) through exp_approx (x clamped: e^{2x} finite). */
static void softcap_in_place(float *s, long L, float cap) {
    const float inv = 1.0f / cap;
#pragma omp simd
    for (long t = 0; t < L; ++t) {
        float x = s[t] * inv;
        x = x > 40.0f ? 40.0f : x < -40.0f ? -40.0f : x;
        s[t] = cap * (1.0f - 2.0f / (exp_approx(2.0f * x) + 1.0f));
    }
}

/* The work of paged_decode_attention, shared out among the threads of the region it is called from. */
/* One attention item: the G query heads at qh (G, dim) of kv head h over the L keys at `slots`, into out (G, dim);
 * `scores` a buffer of G rows `stride` apart; cap > 0 soft-caps the scores first. */
static void attend_kv_head(const float *qh, long G, const float *k_pool, const float *v_pool, const int32_t *slots,
                           long L, long hkv, long h, long dim, float scale, float cap, float *scores, long stride,
                           float *out) {
    decode_scores(qh, G, k_pool, v_pool, slots, L, hkv, h, dim, scale, scores, stride);
    for (long g = 0; g < G; ++g) {
        if (cap > 0.0f) softcap_in_place(scores + g * stride, L, cap);
        softmax_in_place(scores + g * stride, L);
    }
    decode_values_heads(scores, G, stride, v_pool, slots, L, hkv, h, dim, out);
}

static void decode_attention_shared(const float *q, const float *k_pool, const float *v_pool, const int32_t *table,
                                    long table_stride, const int64_t *rows, const int32_t *kv_lens, float *out, long n,
                                    long hq, long hkv, long dim, float scale, long max_len, long window, float cap) {
    const long G = hq / hkv, items = n * hkv, stride = max_len + 8;
    float *scores = malloc(sizeof(float) * (size_t)(G * stride));
#pragma omp for schedule(dynamic, 1) nowait
    for (long item = 0; item < items; ++item) {
        const long h = item / n, i = item % n, start = window > 0 && kv_lens[i] > window ? kv_lens[i] - window : 0;
        const long L = kv_lens[i] - start;
        const int32_t *slots = table + rows[i] * table_stride + start;
        attend_kv_head(q + (i * hq + h * G) * dim, G, k_pool, v_pool, slots, L, hkv, h, dim, scale, cap, scores, stride,
                       out + (i * hq + h * G) * dim);
    }
    free(scores);
}

/* window > 0: each query sees only the last `window` of its kv_lens[i] keys (a sliding-window layer), and only
 * those are read; cap > 0: the scores are soft-capped (cap · tanh(score / cap)) before the softmax. */
void paged_decode_attention(const float *q, const float *k_pool, const float *v_pool, const int32_t *table,
                            long table_stride, const int64_t *rows, const int32_t *kv_lens, float *out, long n,
                            long hq, long hkv, long dim, float scale, long max_len, long window, float cap,
                            int threads) {
#pragma omp parallel num_threads(threads)
    decode_attention_shared(q, k_pool, v_pool, table, table_stride, rows, kv_lens, out, n, hq, hkv, dim, scale, max_len,
                            window, cap);
}

/* x[i] += y[i], a residual */
static inline void add_row(float *x, const float *y, long dim) {
#pragma omp simd
    for (long i = 0; i < dim; ++i) x[i] += y[i];
}

/* ---- the decoder layers of a decode step, in one call ---------------------------------------------
 * The n rows of x (n, H) are n requests' newest tokens, one each (a decode step). Per layer, with y = x:
 *   h = rms_norm(x, norm1); q, k, v = h @ [Wq Wk Wv]ᵀ (joined panels); q, k = rotary(q, k) at each row's
 *   cos/sin (n, D); k, v stored at slot out_slots[r] of this layer's pools (slots, hkv, D); a = attention of
 *   each q over its request's kv_lens[r] keys (paged_decode_attention); x += a @ Woᵀ;
 *   h = rms_norm(x, norm2); g, u = h @ [Wg Wu]ᵀ; x += (silu(g) · u) @ Wdownᵀ
 * — a Llama block as the module path runs it on CPU, through the same kernels (and the same row functions),
 * so x comes out bit for bit as that path's. What the module path runs as ten ctypes calls, a few dozen
 * PyTorch ops and ten OpenMP regions per layer is one region for the whole stack here, the threads meeting
 * at a team_barrier between phases: eight per layer. Two phases need none: an attention item (a request, a
 * K/V head) rotates and stores its own head's q, k and v first (nothing else reads them), and the residual
 * of a layer's MLP and the next layer's first norm run on the same rows by the same thread (static schedule).
 * `layer_ptrs` holds each layer's 8 addresses: norm1, norm2, q/k/v, o, gate/up and down panels, K pool, V
 * pool. `work` holds the intermediates: n · (H + (hq + 2·hkv)·D + hq·D + hkv·D + hq·D + H + 2·inter + inter
 * + H) floats. No bias, no q/k norm, no window, no soft-cap. */
void decode_layers(float *x, long n, long H, long layers, const int64_t *layer_ptrs, float eps, long hq, long hkv,
                   long dim, long inter, const float *cos, const float *sin, const int64_t *out_slots,
                   const int32_t *table, long table_stride, const int64_t *rows, const int32_t *kv_lens, long max_len,
                   float scale, float *work, int threads) {
    const long qkv_cols = (hq + 2 * hkv) * dim, kv_row = hkv * dim, G = hq / hkv, items = n * hkv;
    const long stride = max_len + 8;
    float *h = work, *qkv = h + n * H, *q = qkv + n * qkv_cols, *k = q + n * hq * dim, *att = k + n * kv_row;
    float *o = att + n * hq * dim, *gu = o + n * H, *act = gu + n * 2 * inter, *down = act + n * inter;
    struct team_barrier barrier = {0};
#pragma omp parallel num_threads(threads)
    {
        const int team = omp_get_num_threads();
        float *scores = malloc(sizeof(float) * (size_t)(G * stride));
        for (long l = 0; l < layers; ++l) {
            const int64_t *at = layer_ptrs + 8 * l;
            const float *norm1 = (const float *)at[0], *norm2 = (const float *)at[1];
            const float *qkv_panels = (const float *)at[2], *o_panels = (const float *)at[3];
            const float *gu_panels = (const float *)at[4], *down_panels = (const float *)at[5];
            float *k_pool = (float *)at[6], *v_pool = (float *)at[7];
            /* the previous layer's MLP residual, then this layer's first norm */
#pragma omp for schedule(static) nowait
            for (long r = 0; r < n; ++r) {
                if (l > 0) add_row(x + r * H, down + r * H, H);
                rms_norm_row(x + r * H, norm1, h + r * H, H, eps);
            }
            team_barrier_wait(&barrier, team);
            panel_matmul_shared(h, H, qkv_panels, qkv, n, H, qkv_cols);
            team_barrier_wait(&barrier, team);
#pragma omp for schedule(dynamic, 1) nowait
            for (long item = 0; item < items; ++item) {
                const long g = item / n, i = item % n, L = kv_lens[i];
                const float *row = qkv + i * qkv_cols, *c = cos + i * dim, *s = sin + i * dim;
                float *qh = q + (i * hq + g * G) * dim, *kh = k + i * kv_row + g * dim;
                rotary_row(row + g * G * dim, c, s, qh, G, dim, 0);
                rotary_row(row + (hq + g) * dim, c, s, kh, 1, dim, 0);
                memcpy(k_pool + out_slots[i] * kv_row + g * dim, kh, sizeof(float) * dim);
                memcpy(v_pool + out_slots[i] * kv_row + g * dim, row + (hq + hkv + g) * dim, sizeof(float) * dim);
                attend_kv_head(qh, G, k_pool, v_pool, table + rows[i] * table_stride, L, hkv, g, dim, scale, 0.0f, scores,
                               stride, att + (i * hq + g * G) * dim);
            }
            team_barrier_wait(&barrier, team);
            panel_matmul_shared(att, hq * dim, o_panels, o, n, hq * dim, H);
            team_barrier_wait(&barrier, team);
#pragma omp for schedule(static) nowait
            for (long r = 0; r < n; ++r) {
                add_row(x + r * H, o + r * H, H);
                rms_norm_row(x + r * H, norm2, h + r * H, H, eps);
            }
            team_barrier_wait(&barrier, team);
            panel_matmul_shared(h, H, gu_panels, gu, n, H, 2 * inter);
            team_barrier_wait(&barrier, team);
#pragma omp for schedule(static) nowait
            for (long r = 0; r < n; ++r)
                swiglu_row(gu + r * 2 * inter, gu + r * 2 * inter + inter, act + r * inter, inter);
            team_barrier_wait(&barrier, team);
            panel_matmul_shared(act, inter, down_panels, down, n, inter, H);
            team_barrier_wait(&barrier, team);
        }
#pragma omp for schedule(static) nowait
        for (long r = 0; r < n; ++r) add_row(x + r * H, down + r * H, H);
        free(scores);
    }
}

/* ---- RWKV-4's WKV recurrence over a sequence --------------------------------------------------------
 * Per channel (b, h), with w < 0 the decay and u the current token's bonus (both per h):
 *   y_t = (e^{u+k_t}·v_t + a_t) / (e^{u+k_t} + b_t),  a_{t+1} = e^w·a_t + e^{k_t}·v_t,  b likewise with 1.
 * a and b are kept as aa = a·e^{-pp}, bb = b·e^{-pp} with pp the running maximum exponent (state (3, B, H):
 * aa, bb, pp, read as the start and overwritten with the end). resets (B, T) or NULL: the state restarts
 * (aa = bb = 0, pp = WKV_NONE) before those tokens. k, v, y (B, T, H) contiguous. Threads take (b, block of
 * WKV_LANES channels) items; the lanes of a block are consecutive h, so the time loop's body vectorizes. */
#define WKV_LANES 64
#define WKV_NONE (-1e38f)

static inline float maxf(float a, float b) { return a > b ? a : b; }

void wkv_forward(const float *w, const float *u, const float *k, const float *v, const uint8_t *resets,
                 float *y, float *state, long B, long T, long H, int threads) {
    const long blocks = (H + WKV_LANES - 1) / WKV_LANES;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long item = 0; item < B * blocks; ++item) {
        const long b = item / blocks, h0 = (item % blocks) * WKV_LANES;
        const long n = H - h0 < WKV_LANES ? H - h0 : WKV_LANES;
        float *aa = state + b * H + h0, *bb = aa + B * H, *pp = bb + B * H;
        for (long t = 0; t < T; ++t) {
            const long at = (b * T + t) * H + h0;
            const int reset = resets != NULL && resets[b * T + t];
#pragma omp simd
            for (long i = 0; i < n; ++i) {
                if (reset) { aa[i] = 0.0f; bb[i] = 0.0f; pp[i] = WKV_NONE; }
                const float kt = k[at + i], vt = v[at + i], bonus = u[h0 + i] + kt;
                const float p = maxf(pp[i], bonus), e1 = exp_approx(pp[i] - p), e2 = exp_approx(bonus - p);
                y[at + i] = (e1 * aa[i] + e2 * vt) / (e1 * bb[i] + e2);
                const float decayed = pp[i] + w[h0 + i], q = maxf(decayed, kt);
                const float d1 = exp_approx(decayed - q), d2 = exp_approx(kt - q);
                aa[i] = d1 * aa[i] + d2 * vt;
                bb[i] = d1 * bb[i] + d2;
                pp[i] = q;
            }
        }
    }
}

/* Gradients of Σ_t gy_t·y_t from the start state (state0, not differentiated) and gy (B, T, H):
 * gk, gv (B, T, H); gw, gu (B, H) per row b (summed over b by the caller). scratch (3, B, T, H).
 * Forward sweep: y_t recomputed, with D_t = y_t's scaled denominator and p_t its exponent (the true
 * denominator is D_t·e^{p_t}), G_t = gy_t / D_t. Then ∂/∂a_t = G_t·e^{-p_t}, ∂/∂b_t = -G_t·y_t·e^{-p_t};
 * the direct terms: gv_t = G_t·e^{u+k_t-p_t}, gk_t = gv_t·(v_t - y_t), gu = Σ gk_t's direct part; and
 * gw = Σ_t ∂/∂a_t·a'_t + ∂/∂b_t·b'_t with a' = ∂a/∂w carried in pp's scale: a'_{t+1} = e^w·(a_t + a'_t).
 * Reverse sweep: A_t = Σ_{s>t} ∂/∂a_s·e^{(s-1-t)·w} (and B_t) in a scale e^{r} of their own, the largest
 * exponent of their terms, so gv_t += e^{k_t}·A_t and gk_t += e^{k_t}·(v_t·A_t + B_t) stay within float
 * range (k_t + r ≤ p_s for the s that sets r). A reset before token t cuts A and B: a_t no longer depends
 * on what came before. */
void wkv_backward(const float *w, const float *u, const float *k, const float *v, const uint8_t *resets,
                  const float *state0, const float *gy, float *gk, float *gv, float *gw, float *gu,
                  float *scratch, long B, long T, long H, int threads) {
    const long blocks = (H + WKV_LANES - 1) / WKV_LANES, BTH = B * T * H;
    float *G_a = scratch, *G_b = scratch + BTH, *P = scratch + 2 * BTH;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long item = 0; item < B * blocks; ++item) {
        const long b = item / blocks, h0 = (item % blocks) * WKV_LANES;
        const long n = H - h0 < WKV_LANES ? H - h0 : WKV_LANES;
        float aa[WKV_LANES], bb[WKV_LANES], pp[WKV_LANES], da[WKV_LANES], db[WKV_LANES];
        float sw[WKV_LANES], su[WKV_LANES];
        for (long i = 0; i < n; ++i) {
            aa[i] = state0[b * H + h0 + i];
            bb[i] = state0[B * H + b * H + h0 + i];
            pp[i] = state0[2 * B * H + b * H + h0 + i];
            da[i] = db[i] = sw[i] = su[i] = 0.0f;
        }
        for (long t = 0; t < T; ++t) {
            const long at = (b * T + t) * H + h0;
            const int reset = resets != NULL && resets[b * T + t];
#pragma omp simd
            for (long i = 0; i < n; ++i) {
                if (reset) { aa[i] = bb[i] = da[i] = db[i] = 0.0f; pp[i] = WKV_NONE; }
                const float kt = k[at + i], vt = v[at + i], bonus = u[h0 + i] + kt;
                const float p = maxf(pp[i], bonus), e1 = exp_approx(pp[i] - p), e2 = exp_approx(bonus - p);
                const float D = e1 * bb[i] + e2, yt = (e1 * aa[i] + e2 * vt) / D, G = gy[at + i] / D;
                gv[at + i] = G * e2;
                gk[at + i] = G * e2 * (vt - yt);
                su[i] += G * e2 * (vt - yt);
                sw[i] += G * e1 * (da[i] - yt * db[i]);
                G_a[at + i] = G;
                G_b[at + i] = -G * yt;
                P[at + i] = p;
                const float decayed = pp[i] + w[h0 + i], q = maxf(decayed, kt);
                const float d1 = exp_approx(decayed - q), d2 = exp_approx(kt - q);
                da[i] = d1 * (aa[i] + da[i]);
                db[i] = d1 * (bb[i] + db[i]);
                aa[i] = d1 * aa[i] + d2 * vt;
                bb[i] = d1 * bb[i] + d2;
                pp[i] = q;
            }
        }
        float ra[WKV_LANES], rb[WKV_LANES], r[WKV_LANES];
        for (long i = 0; i < n; ++i) { ra[i] = rb[i] = 0.0f; r[i] = WKV_NONE; }
        for (long t = T - 1; t >= 0; --t) {
            const long at = (b * T + t) * H + h0;
            const int reset = resets != NULL && resets[b * T + t];
#pragma omp simd
            for (long i = 0; i < n; ++i) {
                const float kt = k[at + i], vt = v[at + i], e = exp_approx(kt + r[i]);
                gv[at + i] += e * ra[i];
                gk[at + i] += e * (vt * ra[i] + rb[i]);
                const float carried = r[i] + w[h0 + i], fresh = -P[at + i], r2 = maxf(carried, fresh);
                const float c1 = exp_approx(carried - r2), c2 = exp_approx(fresh - r2);
                ra[i] = reset ? 0.0f : c1 * ra[i] + c2 * G_a[at + i];
                rb[i] = reset ? 0.0f : c1 * rb[i] + c2 * G_b[at + i];
                r[i] = reset ? WKV_NONE : r2;
            }
        }
        for (long i = 0; i < n; ++i) {
            gw[b * H + h0 + i] = sw[i];
            gu[b * H + h0 + i] = su[i];
        }
    }
}
