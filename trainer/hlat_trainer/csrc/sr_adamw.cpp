// Fused AdamW + stochastic rounding to bf16, one pass per tensor, for hlat_trainer.sr_kernel.
//
// Built at first use by hlat_trainer/sr_kernel.py (g++ -O3 -march=native -ffp-contract=off)
// and called through ctypes; no torch headers, so it builds in about a second. The math and
// the random stream must stay bit for bit what sr_kernel's pure-torch path computes: every
// fp32 operation below is one correctly rounded IEEE operation in the order written (no FMA
// contraction), and the noise is a pure function of (key, element index).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline uint32_t fmix32(uint32_t h) {  // MurmurHash3's finaliser: a bijection with full avalanche
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

// 16 uniform bits for element (hi:lo) of a stream keyed by (k0, k1); hmix = hi * golden ratio.
inline uint32_t noise16(uint32_t lo, uint32_t hmix, uint32_t k0, uint32_t k1) {
    return fmix32(fmix32(lo ^ k0) ^ k1 ^ hmix) >> 16;
}

inline uint32_t bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float from_bits(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
inline float bf16_to_f32(uint16_t h) { return from_bits(uint32_t(h) << 16); }

// Stochastic rounding of x's bit pattern: add the noise, keep the high half. NaN stays NaN
// (quiet bit set), +-inf stays, finite values beyond +-bf16 max saturate there.
inline uint16_t sr_bf16(float x, uint32_t noise) {
    const uint32_t u = bits(x), a = u & 0x7FFFFFFFu;
    const uint32_t rounded = (u + noise) >> 16;
    const uint32_t special = a > 0x7F800000u ? ((u >> 16) | 0x40u) : (u >> 16);
    const uint32_t saturated = ((u >> 16) & 0x8000u) | 0x7F7Fu;
    return uint16_t(a >= 0x7F800000u ? special : (a > 0x7F7F0000u ? saturated : rounded));
}

}  // namespace

extern "C" {

// One tensor's range [begin, end) of elements; layout mirrored by sr_kernel._Task.
struct hlat_task {
    void* param;
    const void* grad;
    void* exp_avg;
    void* exp_avg_sq;
    int64_t begin, end;
    uint64_t key_p, key_m, key_v;  // stream keys: weights, first and second moment
    float decay, w1, beta2, c2, inv_bc2, eps, step_size;  // as fp32, see sr_kernel
    int32_t param_bf16, grad_bf16, state_bf16;
};

}  // extern "C"

namespace {

template <bool PB, bool GB, bool SB>
void adamw_range(const hlat_task& t) {
    auto* pp = static_cast<uint16_t*>(t.param);
    auto* pf = static_cast<float*>(t.param);
    const auto* gp = static_cast<const uint16_t*>(t.grad);
    const auto* gf = static_cast<const float*>(t.grad);
    auto* mp = static_cast<uint16_t*>(t.exp_avg);
    auto* mf = static_cast<float*>(t.exp_avg);
    auto* vp = static_cast<uint16_t*>(t.exp_avg_sq);
    auto* vf = static_cast<float*>(t.exp_avg_sq);
    const float decay = t.decay, w1 = t.w1, beta2 = t.beta2, c2 = t.c2;
    const float inv_bc2 = t.inv_bc2, eps = t.eps, step_size = t.step_size;
    const uint32_t kp0 = uint32_t(t.key_p), kp1 = uint32_t(t.key_p >> 32);
    const uint32_t km0 = uint32_t(t.key_m), km1 = uint32_t(t.key_m >> 32);
    const uint32_t kv0 = uint32_t(t.key_v), kv1 = uint32_t(t.key_v >> 32);
    int64_t i = t.begin;
    while (i < t.end) {  // blocks that share the high 32 bits of the element index
        const int64_t block_end = std::min<int64_t>(t.end, ((i >> 32) + 1) << 32);
        const uint32_t hmix = uint32_t(i >> 32) * 0x9E3779B9u;
        const uint32_t lo0 = uint32_t(i);
        const int64_t n = block_end - i;
        auto* pp_ = pp + i; auto* pf_ = pf + i; const auto* gp_ = gp + i; const auto* gf_ = gf + i;
        auto* mp_ = mp + i; auto* mf_ = mf + i; auto* vp_ = vp + i; auto* vf_ = vf + i;
#pragma GCC ivdep
        for (int64_t j = 0; j < n; ++j) {
            const uint32_t lo = lo0 + uint32_t(j);
            float p = PB ? bf16_to_f32(pp_[j]) : pf_[j];
            const float g = GB ? bf16_to_f32(gp_[j]) : gf_[j];
            float m = SB ? bf16_to_f32(mp_[j]) : mf_[j];
            float v = SB ? bf16_to_f32(vp_[j]) : vf_[j];
            p = p * decay;
            m = m + w1 * (g - m);
            v = v * beta2 + c2 * (g * g);
            const float denom = std::sqrt(v) * inv_bc2 + eps;
            p = p + step_size * (m / denom);
            if (PB) pp_[j] = sr_bf16(p, noise16(lo, hmix, kp0, kp1)); else pf_[j] = p;
            if (SB) {
                mp_[j] = sr_bf16(m, noise16(lo, hmix, km0, km1));
                vp_[j] = sr_bf16(v, noise16(lo, hmix, kv0, kv1));
            } else {
                mf_[j] = m;
                vf_[j] = v;
            }
        }
        i = block_end;
    }
}

using range_fn = void (*)(const hlat_task&);
const range_fn kRanges[8] = {
    adamw_range<false, false, false>, adamw_range<false, false, true>,
    adamw_range<false, true, false>,  adamw_range<false, true, true>,
    adamw_range<true, false, false>,  adamw_range<true, false, true>,
    adamw_range<true, true, false>,   adamw_range<true, true, true>,
};

}  // namespace

extern "C" {

int64_t hlat_task_size(void) { return int64_t(sizeof(hlat_task)); }

void hlat_adamw_sr(const hlat_task* tasks, int64_t n_tasks) {
    for (int64_t k = 0; k < n_tasks; ++k) {
        const hlat_task& t = tasks[k];
        kRanges[(t.param_bf16 ? 4 : 0) | (t.grad_bf16 ? 2 : 0) | (t.state_bf16 ? 1 : 0)](t);
    }
}

// dst[j] = SR(src[j]) for j in [0, n), with the noise of element first + j under `key`.
void hlat_sr_bf16(const float* src, uint16_t* dst, int64_t first, int64_t n, uint64_t key) {
    const uint32_t k0 = uint32_t(key), k1 = uint32_t(key >> 32);
    for (int64_t j = 0; j < n; ++j) {
        const int64_t i = first + j;
        const uint32_t hmix = uint32_t(i >> 32) * 0x9E3779B9u;
        dst[j] = sr_bf16(src[j], noise16(uint32_t(i), hmix, k0, k1));
    }
}

}  // extern "C"
