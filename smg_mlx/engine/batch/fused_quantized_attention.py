"""A pass of a few queries a row over quantized keys and values in one CUDA
kernel (engine thread).

Through mlx's ops such a pass is a dozen kernels a layer (the queries'
scale, the keys' product, the mask, softmax, the values' product, casts),
each small: a small model's decode step then waits on launches and on the
device's gaps between them, not on memory. Here one kernel reads the keys
and values quantized, leaves out the positions the mask hides (a whole
buffer's unwritten tail, a row's padding) and keeps a running softmax: one
block per query vector and part of the keys. Where the batch gives too few
blocks to fill the GPU the keys are cut into parts, each block writes its
part's maximum, sum and weighted values, and a second kernel combines them.
Each query head reads its KV head's keys itself (mlx's quantized matmuls,
the path elsewhere, read them once for the KV head's query heads together).

mlx compiles these with NVRTC in seconds, one kernel per dtype, head size,
bits and group size (its quantized matmuls take far longer to build), and
keeps them with its other kernels."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

Quantized = tuple[mx.array, mx.array, mx.array]

WARPS = 4  # warps a block
# Blocks that keep the GPU busy (a few per multiprocessor): where the query
# vectors are fewer, the keys are cut into parts of at least PART_KEYS.
BUSY_BLOCKS = 512
PART_KEYS = 256
# Keys that a pass of one query row of any model here is cut into parts at:
# the warm-up runs one, so both kernels are built before serving.
PARTS_KEYS = 2 * PART_KEYS

AVAILABLE = mx.cuda.is_available()

_HEADER = """
#define SMG_NEG_INF (-__int_as_float(0x7f800000))

"""

# Template: T (queries, out), D (head size), BITS, GROUP, WARPS. A warp's
# lanes work in four groups of eight, each group on a key of its own (a
# lane on an eighth of its dimensions: whole words of one quantization
# group); a step's reads do not wait on the mask (keys it hides are read
# but not counted), so each step waits on memory once.
_PASS = """
constexpr int LANES = 8;                    // a key's lanes
constexpr int READERS = WARPS * (32 / LANES);  // keys a block reads at once
constexpr int DPL = D / LANES;              // a lane's dimensions
constexpr int PER = 32 / BITS;              // codes a word
constexpr int WPL = DPL / PER;              // a lane's words of a key
const int lane = threadIdx.x & 31;
const int reader = threadIdx.x / LANES;  // the lanes reading one key
const int li = lane % LANES;
const int qi = blockIdx.x;
const int part = blockIdx.y;
const int parts = gridDim.y;
const int H = q_shape[1], L = q_shape[2];
const int l = qi % L, h = (qi / L) % H, b = qi / (L * H);
const int kvh = h / (H / kp_shape[1]);
const int N = kp_shape[2];
const int d0 = li * DPL;
const int g = d0 / GROUP;

const T* qrow = q + b * q_strides[0] + h * q_strides[1] + l * q_strides[2];
float qv[DPL];
float qsum = 0.f;
for (int i = 0; i < DPL; ++i) {
  qv[i] = float(qrow[(d0 + i) * q_strides[3]]) * scale[0];
  qsum += qv[i];
}
const bool* mrow = mask + b * mask_strides[0] + (mask_shape[1] == 1 ? 0 : h) * mask_strides[1]
    + l * mask_strides[2];
const uint32_t* kbase = kp + b * kp_strides[0] + kvh * kp_strides[1] + li * WPL;
const uint32_t* vbase = vp + b * vp_strides[0] + kvh * vp_strides[1] + li * WPL;
const size_t ksq = b * ks_strides[0] + kvh * ks_strides[1] + g;
const size_t vsq = b * vs_strides[0] + kvh * vs_strides[1] + g;

const int span = (N + parts - 1) / parts;
const int j0 = part * span, j1 = min(N, j0 + span);
float m = SMG_NEG_INF, s = 0.f, acc[DPL];
for (int i = 0; i < DPL; ++i) acc[i] = 0.f;
for (int base = j0; base < j1; base += READERS) {
  const int j = min(base + reader, j1 - 1);
  const bool counted = base + reader < j1 && mrow[j * mask_strides[3]];
  uint32_t kw[WPL], vw[WPL];
  for (int w = 0; w < WPL; ++w) {
    kw[w] = kbase[j * kp_strides[2] + w];
    vw[w] = vbase[j * vp_strides[2] + w];
  }
  const float kscale = float(ks[ksq + j * ks_strides[2]]);
  const float kbias = float(kb[ksq + j * ks_strides[2]]);
  const float vscale = float(vs[vsq + j * vs_strides[2]]);
  const float vbias = float(vb[vsq + j * vs_strides[2]]);
  float dot = 0.f;
  for (int w = 0; w < WPL; ++w)
    for (int c = 0; c < PER; ++c)
      dot += qv[w * PER + c] * float((kw[w] >> (c * BITS)) & ((1u << BITS) - 1u));
  dot = dot * kscale + qsum * kbias;
  for (int o = LANES / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (counted) {
    const float mn = fmaxf(m, dot);
    const float keep = expf(m - mn);
    const float p = expf(dot - mn);
    s = s * keep + p;
    for (int w = 0; w < WPL; ++w)
      for (int c = 0; c < PER; ++c) {
        const float v = vscale * float((vw[w] >> (c * BITS)) & ((1u << BITS) - 1u)) + vbias;
        acc[w * PER + c] = acc[w * PER + c] * keep + p * v;
      }
    m = mn;
  }
}

__shared__ float om[READERS], os[READERS], oacc[READERS][D];
for (int i = 0; i < DPL; ++i) oacc[reader][d0 + i] = acc[i];
if (li == 0) { om[reader] = m; os[reader] = s; }
__syncthreads();
float M = SMG_NEG_INF;
for (int r = 0; r < READERS; ++r) M = fmaxf(M, om[r]);
float sum = 0.f;
float weight[READERS];
for (int r = 0; r < READERS; ++r) {
  weight[r] = om[r] == SMG_NEG_INF ? 0.f : expf(om[r] - M);
  sum += weight[r] * os[r];
}
"""

# How a block's result is written: the output's row (the keys whole), or its
# part's maximum, sum and unnormalized values (for `_COMBINE`).
_WRITE_WHOLE = """
for (int t = threadIdx.x; t < D; t += blockDim.x) {
  float o = 0.f;
  for (int r = 0; r < READERS; ++r) o += weight[r] * oacc[r][t];
  out[(size_t)qi * D + t] = T(sum > 0.f ? o / sum : 0.f);
}
"""
_WRITE_PARTS = """
for (int t = threadIdx.x; t < D; t += blockDim.x) {
  float o = 0.f;
  for (int r = 0; r < READERS; ++r) o += weight[r] * oacc[r][t];
  part_values[((size_t)qi * parts + part) * D + t] = o;
}
if (threadIdx.x == 0) {
  part_max[(size_t)qi * parts + part] = M;
  part_sum[(size_t)qi * parts + part] = sum;
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

_INPUTS = ["q", "kp", "ks", "kb", "vp", "vs", "vb", "mask", "scale"]
_kernels: dict[bool, Any] = {}
_combine: list[Any] = []
_scales: dict[float, mx.array] = {}


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


def attention(
    queries: mx.array, q_keys: Quantized, q_values: Quantized, scale: float, mask: Any,
    group_size: int, bits: int,
) -> mx.array:  # fmt: skip
    """softmax(queries · keysᵀ · scale, masked) · values for a pass `fits` took."""
    rows, heads, length, dim = queries.shape
    keys = q_keys[0].shape[2]
    if mask is None:
        mask = mx.ones((1, 1, 1, keys), mx.bool_)
    while mask.ndim < 4:
        mask = mx.expand_dims(mask, 0)
    mask = mx.broadcast_to(mask, (rows, mask.shape[1], length, keys))
    if scale not in _scales:
        _scales[scale] = mx.array([scale], mx.float32)
    vectors = rows * heads * length
    parts = max(1, min(-(-keys // PART_KEYS), -(-BUSY_BLOCKS // vectors)))
    template = [("T", queries.dtype), ("D", dim), ("BITS", bits), ("GROUP", group_size),
                ("WARPS", WARPS)]  # fmt: skip
    inputs = [queries, *q_keys, *q_values, mask, _scales[scale]]
    threads = (32 * WARPS, 1, 1)
    if parts == 1:
        (out,) = _kernel(False)(
            inputs=inputs, template=template, grid=(vectors * threads[0], 1, 1),
            threadgroup=threads, output_shapes=[queries.shape], output_dtypes=[queries.dtype],
        )  # fmt: skip
        return out
    per_part = (vectors, parts)
    values, most, total = _kernel(True)(
        inputs=inputs, template=template, grid=(vectors * threads[0], parts, 1),
        threadgroup=threads, output_shapes=[(*per_part, dim), per_part, per_part],
        output_dtypes=[mx.float32] * 3,
    )  # fmt: skip
    (out,) = _combiner()(
        inputs=[values, most, total], template=[("T", queries.dtype), ("D", dim)],
        grid=(vectors * dim, 1, 1), threadgroup=(dim, 1, 1),
        output_shapes=[queries.shape], output_dtypes=[queries.dtype],
    )  # fmt: skip
    return out
