"""The Triton kernels of `hlat_trainer.sr_triton` (which documents them), in their own module
because Triton resolves a kernel's helpers among its module's globals and decides at import
whether to compile or interpret (TRITON_INTERPRET=1): sr_triton imports this at first use."""

# mypy: ignore-errors

import triton
import triton.language as tl


@triton.jit
def fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h

@triton.jit
def noise16(offs, k0, k1):
    lo = (offs & 0xFFFFFFFF).to(tl.uint32)
    hmix = (offs >> 32).to(tl.uint32) * 0x9E3779B9
    return fmix32(fmix32(lo ^ k0.to(tl.uint32)) ^ k1.to(tl.uint32) ^ hmix) >> 16

@triton.jit
def sr_bf16(x, noise):
    u = x.to(tl.uint32, bitcast=True)
    a = u & 0x7FFFFFFF
    top = u >> 16
    rounded = (u + noise) >> 16
    special = tl.where(a > 0x7F800000, top | 0x40, top)  # NaN stays NaN, inf stays inf
    saturated = (top & 0x8000) | 0x7F7F  # finite beyond bf16's range: +-bf16 max
    bits = tl.where(a >= 0x7F800000, special, tl.where(a > 0x7F7F0000, saturated, rounded))
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)

@triton.jit(do_not_specialize=["n", "kp0", "kp1", "km0", "km1", "kv0", "kv1"])
def adamw_sr(p_ptr, g_ptr, m_ptr, v_ptr, n, kp0, kp1, km0, km1, kv0, kv1,
             decay, w1, beta2, c2, inv_bc2, eps, step_size,
             P_BF16: tl.constexpr, S_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    p = p * decay
    m = m + w1 * (g - m)
    v = v * beta2 + c2 * (g * g)
    denom = tl.sqrt_rn(v) * inv_bc2 + eps
    p = p + step_size * tl.div_rn(m, denom)
    if P_BF16:
        tl.store(p_ptr + offs, sr_bf16(p, noise16(offs, kp0, kp1)), mask=mask)
    else:
        tl.store(p_ptr + offs, p, mask=mask)
    if S_BF16:
        tl.store(m_ptr + offs, sr_bf16(m, noise16(offs, km0, km1)), mask=mask)
        tl.store(v_ptr + offs, sr_bf16(v, noise16(offs, kv0, kv1)), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)

@triton.jit(do_not_specialize=["n", "first", "k0", "k1"])
def sr_copy(src_ptr, dst_ptr, n, first, k0, k1, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask)
    tl.store(dst_ptr + offs, sr_bf16(x, noise16(offs + first, k0, k1)), mask=mask)
