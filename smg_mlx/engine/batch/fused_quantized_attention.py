"""A pass of a few queries a row over quantized keys and values in one CUDA
kernel (engine thread).

Through mlx's ops such a pass is a dozen kernels a layer (the queries'
scale, the keys' product, the mask, softmax, the values' product, casts),
each small: a small model's decode step then waits on launches and on the
device's gaps between them, not on memory. Here one kernel reads the keys
and values quantized, leaves out the positions the mask hides (a whole
buffer's unwritten tail, a row's padding) and keeps a running softmax: one
block per KV head's query vectors (as many as a lane's registers hold: a
KV head's query heads, each query of a row) and part of the keys, so that
each key is read once for them all. Where the batch gives too few blocks to
fill the GPU and its rows are long, the keys are cut into parts, each block
writes its part's maximum, sum and weighted values, and a second kernel
combines them.

mlx compiles these with NVRTC in seconds, one kernel per dtype, head size,
bits, group size and vectors a block (its quantized matmuls take far longer
to build), and keeps them with its other kernels."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

Quantized = tuple[mx.array, mx.array, mx.array]

WARPS = 4  # warps a block
# Blocks that keep the GPU busy (a few per multiprocessor): where the blocks
# are fewer, the keys of rows of CUT_FROM keys or more are cut into parts of
# at least PART_KEYS. A cut costs a second kernel and float32 results for
# every part, more than a block reading a few thousand keys more: shorter
# rows are read whole.
BUSY_BLOCKS = 512
PART_KEYS = 256
CUT_FROM = 8192
# Keys that a pass of one query row of any model here is cut into parts at:
# the warm-up runs them at every query count, so both kernels are built before serving.
PARTS_KEYS = CUT_FROM
# A lane's registers for its query vectors' dimensions and sums (`_PASS`):
# a block takes QUERY_FLOATS // (head size / 8) of a KV head's query vectors.
QUERY_FLOATS = 32

AVAILABLE = mx.cuda.is_available()

# A code as a float: its bits under the exponent of 2**23, less 2**23 (the
# integer conversion instruction runs at a fraction of the float rate).
_HEADER = """
#define SMG_NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float smg_code(uint32_t w, int c, int bits) {
  return bits == 8 ? __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540u | c)) - 8388608.f
                   : __uint_as_float(((w >> (4 * c)) & 0xFu) | 0x4B000000u) - 8388608.f;
}

// A 16-bit key or value of the tail as mx.quantize (CUDA) quantizes it, to
// its codes and the scale and bias it stores (in T): the lane's DPL
// dimensions from d0; its group's other lanes, among the 8 in `lanes`, are
// its neighbours (GROUP / DPL of them).
template <typename T, int DPL, int GROUP, int BITS>
__device__ __forceinline__ void smg_quantized(
    const T* x, int64_t stride, unsigned lanes, float* code, float& scale, float& bias) {
  float w[DPL];
  float lo = 3.402823466e38f, hi = 0.f;  // (as mlx's: the maximum starts at 0)
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    w[i] = float(x[i * stride]);
    lo = fminf(lo, w[i]);
    hi = fmaxf(hi, w[i]);
  }
#pragma unroll
  for (int o = 1; o < GROUP / DPL; o <<= 1) {
    lo = fminf(lo, __shfl_xor_sync(lanes, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(lanes, hi, o));
  }
  constexpr float bins = (1 << BITS) - 1;
  float s = fmaxf((hi - lo) / bins, 1e-7f);
  const bool side = fabsf(lo) > fabsf(hi);
  s = side ? s : -s;
  const float edge = side ? lo : hi;
  const float q0 = roundf(edge / s);
  s = q0 == 0.f ? s : edge / q0;
  const float b = q0 == 0.f ? 0.f : edge;
#pragma unroll
  for (int i = 0; i < DPL; ++i) code[i] = fminf(roundf((w[i] - b) / s), bins);
  scale = float(T(s));
  bias = float(T(b));
}
"""

# Template: T (queries, out), D (head size), BITS, GROUP, WARPS, QV. A block
# takes QV query vectors of one KV head (its query heads' queries, in the
# output's order) and part of the keys: each key is read and its codes
# converted once for all of them. A warp's lanes work in four groups of
# eight, each group on a key of its own (a lane on an eighth of its
# dimensions: whole words of one quantization group). A value's scale and
# bias are applied per key, not per dimension: the weighted codes and the
# weighted biases are summed apart. A step's reads do not wait on the mask
# (keys it hides are read but not counted).
_PASS = """
constexpr int LANES = 8;                    // a key's lanes
constexpr int READERS = WARPS * (32 / LANES);  // keys a block reads at once
constexpr int DPL = D / LANES;              // a lane's dimensions
constexpr int PER = 32 / BITS;              // codes a word
constexpr int WPL = DPL / PER;              // a lane's words of a key
const int lane = threadIdx.x & 31;
const int reader = threadIdx.x / LANES;  // the lanes reading one key
const int li = lane % LANES;
const int H = q_shape[1], L = q_shape[2];
const int KVH = kp_shape[1];
const int GL = H / KVH * L;  // a KV head's query vectors
const int tiles = (GL + QV - 1) / QV;
const int tile = blockIdx.x % tiles;
const int bk = blockIdx.x / tiles;  // row * KVH + KV head
const int kvh = bk % KVH, b = bk / KVH;
const int part = blockIdx.y;
const int parts = gridDim.y;
const int NQ = kp_shape[2];  // quantized keys; then the 16-bit tail's, to the mask's width
const int N = mask_shape[3];
const int d0 = li * DPL;
const int g = d0 / GROUP;

float qv[QV][DPL], qsum[QV];
size_t mrow[QV];
bool live[QV];
#pragma unroll
for (int v = 0; v < QV; ++v) {
  const int vi = tile * QV + v;
  live[v] = vi < GL;
  const int vv = live[v] ? vi : 0;  // past the last vector: the first's, not counted
  const int h = kvh * (H / KVH) + vv / L, l = vv % L;
  const T* qrow = q + b * q_strides[0] + h * q_strides[1] + l * q_strides[2];
  qsum[v] = 0.f;
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    qv[v][i] = float(qrow[(d0 + i) * q_strides[3]]) * scale[0];
    qsum[v] += qv[v][i];
  }
  mrow[v] = b * mask_strides[0] + (mask_shape[1] == 1 ? 0 : h) * mask_strides[1]
      + l * mask_strides[2];
}
const uint32_t* kbase = kp + b * kp_strides[0] + kvh * kp_strides[1] + li * WPL;
const uint32_t* vbase = vp + b * vp_strides[0] + kvh * vp_strides[1] + li * WPL;
const size_t ksq = b * ks_strides[0] + kvh * ks_strides[1] + g;
const size_t vsq = b * vs_strides[0] + kvh * vs_strides[1] + g;

const int span = (N + parts - 1) / parts;
const int j0 = part * span, j1 = min(N, j0 + span);
float m[QV], s[QV], bsum[QV], acc[QV][DPL];
#pragma unroll
for (int v = 0; v < QV; ++v) {
  m[v] = SMG_NEG_INF; s[v] = 0.f; bsum[v] = 0.f;
#pragma unroll
  for (int i = 0; i < DPL; ++i) acc[v][i] = 0.f;
}
const unsigned lanes = 0xFFu << (lane & ~(LANES - 1));  // a key's lanes, for the tail's
for (int base = j0; base < j1; base += READERS) {
  const int j = min(base + reader, j1 - 1);
  const bool inside = base + reader < j1;
  float kc[DPL], vc[DPL], kscale, kbias, vscale, vbias;
  if (j < NQ) {
    uint32_t kw[WPL], vw[WPL];
#pragma unroll
    for (int w = 0; w < WPL; ++w) {
      kw[w] = kbase[j * kp_strides[2] + w];
      vw[w] = vbase[j * vp_strides[2] + w];
    }
#pragma unroll
    for (int w = 0; w < WPL; ++w)
#pragma unroll
      for (int c = 0; c < PER; ++c) {
        kc[w * PER + c] = smg_code(kw[w], c, BITS);
        vc[w * PER + c] = smg_code(vw[w], c, BITS);
      }
    kscale = float(ks[ksq + j * ks_strides[2]]);
    kbias = float(kb[ksq + j * ks_strides[2]]);
    vscale = float(vs[vsq + j * vs_strides[2]]);
    vbias = float(vb[vsq + j * vs_strides[2]]);
  } else {
    const int t = j - NQ;
    smg_quantized<T, DPL, GROUP, BITS>(
        tk + b * tk_strides[0] + kvh * tk_strides[1] + t * tk_strides[2] + d0 * tk_strides[3],
        tk_strides[3], lanes, kc, kscale, kbias);
    smg_quantized<T, DPL, GROUP, BITS>(
        tv + b * tv_strides[0] + kvh * tv_strides[1] + t * tv_strides[2] + d0 * tv_strides[3],
        tv_strides[3], lanes, vc, vscale, vbias);
  }
  bool counted[QV];
#pragma unroll
  for (int v = 0; v < QV; ++v)
    counted[v] = inside && live[v] && mask[mrow[v] + j * mask_strides[3]];
  float dot[QV];
#pragma unroll
  for (int v = 0; v < QV; ++v) dot[v] = 0.f;
#pragma unroll
  for (int i = 0; i < DPL; ++i)
#pragma unroll
    for (int v = 0; v < QV; ++v) dot[v] += qv[v][i] * kc[i];
  // (a lane's scale and bias: its own group's, so applied before the lanes' sum)
#pragma unroll
  for (int v = 0; v < QV; ++v) dot[v] = dot[v] * kscale + qsum[v] * kbias;
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1)
#pragma unroll
    for (int v = 0; v < QV; ++v) dot[v] += __shfl_xor_sync(0xffffffffu, dot[v], o);
  float keep[QV], pv[QV];
#pragma unroll
  for (int v = 0; v < QV; ++v) {
    const float x = counted[v] ? dot[v] : SMG_NEG_INF;
    const float mn = fmaxf(m[v], x);
    keep[v] = mn == SMG_NEG_INF ? 1.f : expf(m[v] - mn);
    const float p = mn == SMG_NEG_INF ? 0.f : expf(x - mn);
    s[v] = s[v] * keep[v] + p;
    // (a hidden key's scale and bias may be any bits)
    bsum[v] = bsum[v] * keep[v] + (counted[v] ? p * vbias : 0.f);
    pv[v] = counted[v] ? p * vscale : 0.f;
    m[v] = mn;
  }
#pragma unroll
  for (int i = 0; i < DPL; ++i)
#pragma unroll
    for (int v = 0; v < QV; ++v) acc[v][i] = acc[v][i] * keep[v] + pv[v] * vc[i];
}

__shared__ float om[QV][READERS], os[QV][READERS], oacc[QV][READERS][D];
#pragma unroll
for (int v = 0; v < QV; ++v) {
#pragma unroll
  for (int i = 0; i < DPL; ++i) oacc[v][reader][d0 + i] = acc[v][i] + bsum[v];
  if (li == 0) { om[v][reader] = m[v]; os[v][reader] = s[v]; }
}
__syncthreads();
for (int v = 0; v < QV && tile * QV + v < GL; ++v) {
  const size_t qi = (size_t)bk * GL + tile * QV + v;
  float M = SMG_NEG_INF;
  for (int r = 0; r < READERS; ++r) M = fmaxf(M, om[v][r]);
  float sum = 0.f;
  for (int r = 0; r < READERS; ++r)
    if (om[v][r] != SMG_NEG_INF) sum += expf(om[v][r] - M) * os[v][r];
"""

# How a block's results are written, for each of its vectors `qi` (in the
# loop `_PASS` leaves open): the output's row (the keys whole), or its
# part's maximum, sum and unnormalized values (for `_COMBINE`).
_WRITE_WHOLE = """
  for (int t = threadIdx.x; t < D; t += blockDim.x) {
    float o = 0.f;
    for (int r = 0; r < READERS; ++r)
      if (om[v][r] != SMG_NEG_INF) o += expf(om[v][r] - M) * oacc[v][r][t];
    out[qi * D + t] = T(sum > 0.f ? o / sum : 0.f);
  }
}
"""
_WRITE_PARTS = """
  for (int t = threadIdx.x; t < D; t += blockDim.x) {
    float o = 0.f;
    for (int r = 0; r < READERS; ++r)
      if (om[v][r] != SMG_NEG_INF) o += expf(om[v][r] - M) * oacc[v][r][t];
    part_values[(qi * parts + part) * D + t] = o;
  }
  if (threadIdx.x == 0) {
    part_max[qi * parts + part] = M;
    part_sum[qi * parts + part] = sum;
  }
}
"""

_COMBINE = """
const int qi = blockIdx.x;
const int parts = part_max_shape[1];
float M = SMG_NEG_INF;
for (int p = 0; p < parts; ++p) M = fmaxf(M, part_max[qi * parts + p]);
float sum = 0.f;
for (int p = 0; p < parts; ++p) {
  const float mp = part_max[qi * parts + p];
  if (mp != SMG_NEG_INF) sum += expf(mp - M) * part_sum[qi * parts + p];
}
for (int t = threadIdx.x; t < D; t += blockDim.x) {
  float o = 0.f;
  for (int p = 0; p < parts; ++p) {
    const float mp = part_max[qi * parts + p];
    if (mp != SMG_NEG_INF) o += expf(mp - M) * part_values[((size_t)qi * parts + p) * D + t];
  }
  out[(size_t)qi * D + t] = T(sum > 0.f ? o / sum : 0.f);
}
"""

_INPUTS = ["q", "kp", "ks", "kb", "vp", "vs", "vb", "tk", "tv", "mask", "scale"]
_kernels: dict[bool, Any] = {}
_combine: list[Any] = []
_scales: dict[float, mx.array] = {}
_no_tails: dict[tuple[Any, int], mx.array] = {}  # what a pass without a tail passes as one


def _kernel(split: bool) -> Any:
    if split not in _kernels:
        outputs = ["part_values", "part_max", "part_sum"] if split else ["out"]
        _kernels[split] = mx.fast.cuda_kernel(
            name="smg_quantized_few_" + ("parts" if split else "whole"),
            input_names=_INPUTS, output_names=outputs, header=_HEADER,
            source=_PASS + (_WRITE_PARTS if split else _WRITE_WHOLE),
            ensure_row_contiguous=False,
        )  # fmt: skip
    return _kernels[split]


def _combiner() -> Any:
    if not _combine:
        _combine.append(mx.fast.cuda_kernel(
            name="smg_quantized_few_combine", input_names=["part_values", "part_max", "part_sum"],
            output_names=["out"], source=_COMBINE, header=_HEADER,
        ))  # fmt: skip
    return _combine[0]


def _vectors_a_block(vectors: int, dim: int) -> int:
    """The query vectors a block takes, of a KV head's `vectors`: a power of
    two (a kernel each), as many as a lane's QUERY_FLOATS hold."""
    most = max(1, QUERY_FLOATS // (dim // 8))
    each = 1
    while each < min(vectors, most):
        each *= 2
    return min(each, most)


def fits_kind(key_dim: int, value_dim: int, group_size: int, bits: int) -> bool:
    """Whether passes of these heads can run here: on CUDA, keys and values
    of one head size whose eighths are whole words of one quantization group
    (`_PASS`), at 4 or 8 bits."""
    eighth = key_dim // 8
    return (
        AVAILABLE and key_dim == value_dim and key_dim % 8 == 0 and bits in (4, 8)
        and eighth * bits % 32 == 0 and group_size % eighth == 0
    )  # fmt: skip


def fits(queries: mx.array, q_keys: Quantized, q_values: Quantized, mask: Any,
         group_size: int, bits: int) -> bool:  # fmt: skip
    """Whether `attention` takes this pass: `fits_kind`, and a boolean mask
    (or none) alike for a KV head's query heads."""
    mask_ok = mask is None or (
        isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim <= 4
        and (mask.ndim < 4 or mask.shape[1] in (1, queries.shape[1]))
    )  # fmt: skip
    key_dim, value_dim = (q[1].shape[-1] * group_size for q in (q_keys, q_values))
    return mask_ok and queries.shape[-1] == key_dim and fits_kind(
        key_dim, value_dim, group_size, bits
    )


Launch = Callable[[mx.array, tuple, tuple], mx.array]


def launcher(
    queries: mx.array, q_keys: Quantized, q_values: Quantized, scale: float, mask: Any,
    group_size: int, bits: int,
) -> Launch:  # fmt: skip
    """`attention` for a pass that `fits`, as a call of its queries, keys and
    values alone: what follows from their shapes and the mask (the mask as
    the kernel reads it, the launch) is worked out here, once for the layers
    of a pass that bring the same (`quantized_attention.FewQueryPasses`)."""
    rows, heads, length, dim = queries.shape
    keys = q_keys[0].shape[2] + (q_keys[3].shape[2] if len(q_keys) > 3 else 0)
    if (queries.dtype, dim) not in _no_tails:
        _no_tails[queries.dtype, dim] = mx.zeros((1, 1, 1, dim), queries.dtype)
    no_tails = [_no_tails[queries.dtype, dim]] * 2
    if mask is None:
        mask = mx.ones((1, 1, 1, keys), mx.bool_)
    while mask.ndim < 4:
        mask = mx.expand_dims(mask, 0)
    mask = mx.broadcast_to(mask, (rows, mask.shape[1], length, keys))
    if scale not in _scales:
        _scales[scale] = mx.array([scale], mx.float32)
    after = [mask, _scales[scale]]
    kv_heads = q_keys[0].shape[1]
    vectors = heads // kv_heads * length  # a KV head's
    each = _vectors_a_block(vectors, dim)
    blocks = rows * kv_heads * -(-vectors // each)
    parts = 1 if keys < CUT_FROM else min(-(-keys // PART_KEYS), -(-BUSY_BLOCKS // blocks))
    template = [("T", queries.dtype), ("D", dim), ("BITS", bits), ("GROUP", group_size),
                ("WARPS", WARPS), ("QV", each)]  # fmt: skip
    threads = (32 * WARPS, 1, 1)
    shapes, dtypes = [queries.shape], [queries.dtype]

    def inputs(queries: mx.array, q_keys: tuple, q_values: tuple) -> list[mx.array]:
        tails = [q_keys[3], q_values[3]] if len(q_keys) > 3 else no_tails
        return [queries, *q_keys[:3], *q_values[:3], *tails, *after]

    if parts == 1:
        whole = _kernel(False)

        def run(queries: mx.array, q_keys: tuple, q_values: tuple) -> mx.array:
            (out,) = whole(
                inputs=inputs(queries, q_keys, q_values), template=template,
                grid=(blocks * threads[0], 1, 1), threadgroup=threads,
                output_shapes=shapes, output_dtypes=dtypes,
            )  # fmt: skip
            return out

        return run
    per_part = (rows * heads * length, parts)
    split, combine = _kernel(True), _combiner()

    def run_parts(queries: mx.array, q_keys: tuple, q_values: tuple) -> mx.array:
        values, most, total = split(
            inputs=inputs(queries, q_keys, q_values), template=template,
            grid=(blocks * threads[0], parts, 1), threadgroup=threads,
            output_shapes=[(*per_part, dim), per_part, per_part], output_dtypes=[mx.float32] * 3,
        )  # fmt: skip
        (out,) = combine(
            inputs=[values, most, total], template=[("T", queries.dtype), ("D", dim)],
            grid=(per_part[0] * dim, 1, 1), threadgroup=(dim, 1, 1),
            output_shapes=shapes, output_dtypes=dtypes,
        )  # fmt: skip
        return out

    return run_parts


def attention(
    queries: mx.array, q_keys: Quantized, q_values: Quantized, scale: float, mask: Any,
    group_size: int, bits: int,
) -> mx.array:  # fmt: skip
    """softmax(queries · keysᵀ · scale, masked) · values for a pass `fits` took;
    the keys and values may each end with a 16-bit tail (`quantized_kv.TAILS`),
    whose positions the mask has after the quantized ones."""
    run = launcher(queries, q_keys, q_values, scale, mask, group_size, bits)
    return run(queries, q_keys, q_values)
