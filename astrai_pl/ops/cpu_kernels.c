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
