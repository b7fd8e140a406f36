/* Fused CPU kernels: one pass over the rows where PyTorch's eager ops take several.
 *
 * Built by astrai_pl/ops/cpu.py with the host C compiler (-O3 -march=native -fopenmp) into a small
 * shared library called through ctypes: no PyTorch headers, a second of compiling. OpenMP resolves
 * to the runtime PyTorch has already loaded (same soname), so both share one thread pool.
 *
 * Every tensor is float32, contiguous, rows x dim. Sums are taken in float, as PyTorch's CPU mean is.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) per row; rstd is kept for the backward. */
void rms_norm_forward(const float *x, const float *w, float *y, float *rstd, long rows, long dim, float eps,
                      int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; ++r) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (long i = 0; i < dim; ++i) ss += xr[i] * xr[i];
        const float s = 1.0f / sqrtf(ss / (float)dim + eps);
        rstd[r] = s;
#pragma omp simd
        for (long i = 0; i < dim; ++i) yr[i] = xr[i] * s * w[i];
    }
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

/* Rotary embedding in the rotate-half layout, on x (rows, heads, dim) with cos/sin (rows, dim):
 *   forward   out = x * cos + rotate_half(x) * sin,      rotate_half(x) = [-x2, x1]
 *   backward  out = x * cos + rotate_half^T(x * sin),    rotate_half^T(z) = [z2, -z1]
 * (the backward of a rotation is the rotation back). `x_stride` is the distance between rows of x. */
void rotary(const float *x, long x_stride, const float *cos, const float *sin, float *out, long rows, long heads,
            long dim, int backward, int threads) {
    const long half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; ++r) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (long h = 0; h < heads; ++h) {
            const float *xr = x + r * x_stride + h * dim;
            float *o = out + (r * heads + h) * dim;
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
}

/* ---- matmul of a few rows against a weight packed in 64-column panels -------------------------------
 * y (M, N) = x (M, K) @ W^T for W (N, K), with W packed as panels (ceil(N/64), K, 64): panel p holds
 * columns 64p…64p+63, each k a contiguous run of 64 floats, so a panel is read as one stream. A tile of
 * up to 6 rows x 64 columns lives in 24 vector registers while k runs; each row block re-reads the panel
 * from L2, and while it does, it prefetches its share of the next panel into L2 (spread over its steps), so
 * the weights stream from memory behind the arithmetic instead of ahead of it. With the few rows of a
 * decode step this is bound by reading the weights, which is what it is built to do fast. */
typedef float vec16 __attribute__((vector_size(64), aligned(4)));
#define PANEL 64
#define TILE_ROWS 6

#define DEFINE_TILE(R)                                                                                   \
    static void tile##R(const float *x, long ldx, const float *wp, float *y, long ldy, long K, long cols, \
                        const char *pf, long pf_lines, long per_step) {                                   \
        vec16 acc[R][4];                                                                                  \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = (vec16){0}; \
        for (long k = 0; k < K; ++k, wp += PANEL) {                                                       \
            for (long l = k * per_step; l < (k + 1) * per_step && l < pf_lines; ++l)                     \
                __builtin_prefetch(pf + l * 64, 0, 2);                                                    \
            const vec16 b0 = *(const vec16 *)wp, b1 = *(const vec16 *)(wp + 16);                          \
            const vec16 b2 = *(const vec16 *)(wp + 32), b3 = *(const vec16 *)(wp + 48);                   \
            _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) {                                         \
                const float a = x[m * ldx + k];                                                           \
                acc[m][0] += a * b0; acc[m][1] += a * b1; acc[m][2] += a * b2; acc[m][3] += a * b3;       \
            }                                                                                             \
        }                                                                                                 \
        /* constant-size stores only: a variable-size copy out of acc would keep it in memory, not registers */ \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) {                                             \
            if (cols == PANEL) {                                                                          \
                memcpy(y + m * ldy, acc[m], sizeof(acc[m]));                                              \
            } else {                                                                                      \
                float last[PANEL];                                                                        \
                memcpy(last, acc[m], sizeof(last));                                                       \
                memcpy(y + m * ldy, last, sizeof(float) * cols);                                          \
            }                                                                                             \
        }                                                                                                 \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)

void panel_matmul(const float *x, long ldx, const float *panels, float *y, long M, long K, long N, int threads) {
    if (M <= 0 || K <= 0 || N <= 0) return;
    const long num_panels = (N + PANEL - 1) / PANEL, panel_size = (long)PANEL * K;
    const long lines = panel_size * (long)sizeof(float) / 64, passes = (M + TILE_ROWS - 1) / TILE_ROWS;
    const long share = (lines + passes - 1) / passes; /* lines of the next panel each row block prefetches */
    const long per_step = (share + K - 1) / K;        /* spread over its K steps */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < num_panels; ++p) {
        const float *wp = panels + p * panel_size;
        const int last = p + 1 == num_panels;
        const char *next = (const char *)(panels + (p + 1) * panel_size);
        const long cols = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
        for (long pass = 0, m0 = 0; m0 < M; m0 += TILE_ROWS, ++pass) {
            const long first = pass * share, todo = last ? 0 : (lines - first < share ? lines - first : share);
            const float *xx = x + m0 * ldx;
            float *yy = y + m0 * N + p * PANEL;
            const char *pf = last ? (const char *)wp : next + first * 64; /* the last panel prefetches nothing */
            switch (M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS) {
                case 1: tile1(xx, ldx, wp, yy, N, K, cols, pf, todo, per_step); break;
                case 2: tile2(xx, ldx, wp, yy, N, K, cols, pf, todo, per_step); break;
                case 3: tile3(xx, ldx, wp, yy, N, K, cols, pf, todo, per_step); break;
                case 4: tile4(xx, ldx, wp, yy, N, K, cols, pf, todo, per_step); break;
                case 5: tile5(xx, ldx, wp, yy, N, K, cols, pf, todo, per_step); break;
                default: tile6(xx, ldx, wp, yy, N, K, cols, pf, todo, per_step); break;
            }
        }
    }
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

/* out (rows, cols) = gate * sigmoid(gate) * up; gate and up rows `g_stride` / `u_stride` floats apart. */
void swiglu_forward(const float *gate, long g_stride, const float *up, long u_stride, float *out, long rows,
                    long cols, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; ++r) {
        const float *g = gate + r * g_stride, *u = up + r * u_stride;
        float *o = out + r * cols;
#pragma omp simd
        for (long i = 0; i < cols; ++i) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
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
