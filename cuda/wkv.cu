// RWKV-4's WKV recurrence over a sequence, forward and backward, float32 (astrai_pl/model/rwkv.py casts to
// it). One thread per channel (b, h) walks the sequence; a warp's threads are consecutive h, so each step's
// loads of k and v are coalesced. The arithmetic is cpu_kernels.c's: the stable form with aa, bb scaled by
// e^{-pp}; the backward recomputes the forward (gradients of w and u, each token's direct terms) and then
// sweeps back in time with the carried gradient in a scale of its own (see cpu_kernels.c).
#include "common.cuh"

namespace astrai {
namespace {

constexpr int kThreads = 128;
constexpr float kNone = -1e38f;  // pp before any token

__global__ void __launch_bounds__(kThreads) wkv_forward_kernel(const WkvArgs a) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= a.batch * a.channels) return;
  const int64_t b = c / a.channels, h = c % a.channels, H = a.channels, BH = a.batch * H;
  float aa = a.state[c], bb = a.state[BH + c], pp = a.state[2 * BH + c];
  const float w = a.w[h], u = a.u[h];
  for (int64_t t = 0; t < a.steps; ++t) {
    const int64_t at = (b * a.steps + t) * H + h;
    if (a.resets != nullptr && a.resets[b * a.steps + t]) { aa = 0.0f; bb = 0.0f; pp = kNone; }
    const float kt = a.k[at], vt = a.v[at], bonus = u + kt;
    const float p = fmaxf(pp, bonus), e1 = __expf(pp - p), e2 = __expf(bonus - p);
    a.y[at] = (e1 * aa + e2 * vt) / (e1 * bb + e2);
    const float decayed = pp + w, q = fmaxf(decayed, kt), d1 = __expf(decayed - q), d2 = __expf(kt - q);
    aa = d1 * aa + d2 * vt;
    bb = d1 * bb + d2;
    pp = q;
  }
  a.state[c] = aa;
  a.state[BH + c] = bb;
  a.state[2 * BH + c] = pp;
}

__global__ void __launch_bounds__(kThreads) wkv_backward_kernel(const WkvArgs a) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= a.batch * a.channels) return;
  const int64_t b = c / a.channels, h = c % a.channels, H = a.channels, BH = a.batch * H;
  const int64_t BTH = BH * a.steps;
  float *g_a = a.scratch, *g_b = a.scratch + BTH, *p_at = a.scratch + 2 * BTH;
  float aa = a.state[c], bb = a.state[BH + c], pp = a.state[2 * BH + c], da = 0.0f, db = 0.0f;
  float sw = 0.0f, su = 0.0f;
  const float w = a.w[h], u = a.u[h];
  for (int64_t t = 0; t < a.steps; ++t) {
    const int64_t at = (b * a.steps + t) * H + h;
    if (a.resets != nullptr && a.resets[b * a.steps + t]) { aa = bb = da = db = 0.0f; pp = kNone; }
    const float kt = a.k[at], vt = a.v[at], bonus = u + kt;
    const float p = fmaxf(pp, bonus), e1 = __expf(pp - p), e2 = __expf(bonus - p);
    const float D = e1 * bb + e2, yt = (e1 * aa + e2 * vt) / D, G = a.gy[at] / D;
    a.gv[at] = G * e2;
    a.gk[at] = G * e2 * (vt - yt);
    su += G * e2 * (vt - yt);
    sw += G * e1 * (da - yt * db);
    g_a[at] = G;
    g_b[at] = -G * yt;
    p_at[at] = p;
    const float decayed = pp + w, q = fmaxf(decayed, kt), d1 = __expf(decayed - q), d2 = __expf(kt - q);
    da = d1 * (aa + da);
    db = d1 * (bb + db);
    aa = d1 * aa + d2 * vt;
    bb = d1 * bb + d2;
    pp = q;
  }
  float ra = 0.0f, rb = 0.0f, r = kNone;
  for (int64_t t = a.steps - 1; t >= 0; --t) {
    const int64_t at = (b * a.steps + t) * H + h;
    const float kt = a.k[at], vt = a.v[at], e = __expf(kt + r);
    a.gv[at] += e * ra;
    a.gk[at] += e * (vt * ra + rb);
    if (a.resets != nullptr && a.resets[b * a.steps + t]) {
      ra = rb = 0.0f;
      r = kNone;
      continue;
    }
    const float carried = r + w, fresh = -p_at[at], r2 = fmaxf(carried, fresh);
    const float c1 = __expf(carried - r2), c2 = __expf(fresh - r2);
    ra = c1 * ra + c2 * g_a[at];
    rb = c1 * rb + c2 * g_b[at];
    r = r2;
  }
  a.gw[c] = sw;
  a.gu[c] = su;
}

int blocks(const WkvArgs& a) { return static_cast<int>((a.batch * a.channels + kThreads - 1) / kThreads); }

}  // namespace

int wkv_forward(const WkvArgs& a, cudaStream_t stream) {
  if (a.batch * a.channels > 0) wkv_forward_kernel<<<blocks(a), kThreads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

int wkv_backward(const WkvArgs& a, cudaStream_t stream) {
  if (a.batch * a.channels > 0) wkv_backward_kernel<<<blocks(a), kThreads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace astrai
