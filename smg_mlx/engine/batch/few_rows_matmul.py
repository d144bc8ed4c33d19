"""Linear layers of a pass of a few rows in a CUDA kernel of ours (engine thread).

mlx multiplies one row by a weight matrix with a matrix-vector kernel that
reads the weights at close to the memory's speed, and two rows or more with
cuBLAS, whose kernels for so few rows take two to three times as long on the
projections of a small or middling model (measured on an H200): a decode step
of 2-8 streams, or a pass checking one stream's proposals (`speculative`), is
slowed by it throughout. Here a warp takes a few of the weights' rows and
every input row: it reads each weight once, in 16-byte words, and keeps a
float sum per input and output row, so a row's result does not depend on the
rows beside it. Past a few rows, the more so the larger the matrix, the sums
outgrow what its registers and cores do faster than cuBLAS: `most_rows`.

Only the model's plain `nn.Linear` layers with 16-bit weights take it (not
quantized layers, whose kernels are mlx's), and only once the kernel has
given mlx's own products at start-up (`install`)."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)

AVAILABLE = mx.cuda.is_available()
DTYPES = (mx.bfloat16, mx.float16)
LEAST_ROWS = 2  # one row is mlx's matrix-vector kernel's
# The most rows a product takes here, by the weight's size (elements): up to
# each bound, this kernel ran faster than cuBLAS on every shape measured.
MOST_ROWS = ((1 << 24, 8), (1 << 26, 5), (None, 2))
WORDS = 8  # 16-bit values a 16-byte word holds

# Template: T (16-bit), M (input rows), C (weight rows a warp). A lane reads a
# word of each of its warp's C weight rows and of each input row, K / 256
# times along the rows; the warp then sums its lanes.
_SOURCE = """
const int lane = threadIdx.x & 31;
const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const int K = w_shape[1], N = w_shape[0];
const int n0 = warp * C;
if (n0 >= N) return;
float acc[M][C];
#pragma unroll
for (int m = 0; m < M; ++m)
#pragma unroll
  for (int c = 0; c < C; ++c) acc[m][c] = 0.f;
for (int k = lane * 8; k < K; k += 256) {
  float wf[C][8];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    T wv[8];
    const int n = min(n0 + c, N - 1);
    *reinterpret_cast<uint4*>(wv) = *reinterpret_cast<const uint4*>(w + (int64_t)n * K + k);
#pragma unroll
    for (int i = 0; i < 8; ++i) wf[c][i] = float(wv[i]);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    T xv[8];
    *reinterpret_cast<uint4*>(xv) = *reinterpret_cast<const uint4*>(x + (int64_t)m * K + k);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float xf = float(xv[i]);
#pragma unroll
      for (int c = 0; c < C; ++c) acc[m][c] += xf * wf[c][i];
    }
  }
}
#pragma unroll
for (int m = 0; m < M; ++m)
#pragma unroll
  for (int c = 0; c < C; ++c) {
    float v = acc[m][c];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    acc[m][c] = v;
  }
if (lane == 0) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int c = 0; c < C; ++c)
      if (n0 + c < N) out[(int64_t)m * N + n0 + c] = T(acc[m][c]);
}
"""
WARPS = 4  # warps a block
_kernel: list[Any] = []


def most_rows(weight_elements: int) -> int:
    """The most input rows a product with a weight of this many elements takes here."""
    for bound, rows in MOST_ROWS:
        if bound is None or weight_elements <= bound:
            return rows
    raise AssertionError("MOST_ROWS ends with no bound")


def fits(weight: mx.array) -> bool:
    """Whether products with this weight (out x in) can run here."""
    return weight.ndim == 2 and weight.dtype in DTYPES and weight.shape[1] % WORDS == 0


def matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x (rows x in) times weightᵀ, for LEAST_ROWS to `most_rows` rows of a
    weight that `fits`, in x's dtype (the weight's)."""
    if not _kernel:
        _kernel.append(mx.fast.cuda_kernel(
            name="smg_few_rows_matmul", input_names=["x", "w"], output_names=["out"],
            source=_SOURCE,
        ))  # fmt: skip
    rows = x.shape[0]
    each = 4 if rows <= 4 else 2  # weight rows a warp: fewer where each has more sums
    warps = -(-weight.shape[0] // each)
    blocks = -(-warps // WARPS)
    (out,) = _kernel[0](
        inputs=[x, weight], template=[("T", x.dtype), ("M", rows), ("C", each)],
        grid=(blocks * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(rows, weight.shape[0])], output_dtypes=[x.dtype],
    )  # fmt: skip
    return out


class FewRowsLinear(nn.Linear):
    """An `nn.Linear` whose products of a few rows run in `matmul`."""

    most = 0  # the most rows its products take here (`install`: by its weight's size)

    def __call__(self, x: mx.array) -> mx.array:
        # (every layer of every pass comes here: one row, the commonest, is let through first)
        rows = x.size // x.shape[-1]
        if rows < LEAST_ROWS or rows > self.most or x.dtype != self["weight"].dtype:
            return nn.Linear.__call__(self, x)
        out = matmul(x.reshape(rows, x.shape[-1]), self["weight"]).reshape(*x.shape[:-1], -1)
        return out + self["bias"] if "bias" in self else out


def _layers(model: nn.Module) -> list[nn.Linear]:
    return [m for _, m in model.named_modules() if type(m) is nn.Linear and fits(m["weight"])]


def install(model: nn.Module) -> int:
    """Route the model's fitting linear layers through `matmul`, once the kernel
    has given mlx's products for every row count it takes (each built now, so
    no request waits on a build); how many layers it took. Nothing where mlx
    has no CUDA device or no layer fits."""
    layers = _layers(model) if AVAILABLE else []
    if not layers:
        return 0
    weight = layers[0]["weight"]
    x = mx.random.normal((most_rows(0), weight.shape[1]), key=mx.random.key(0)).astype(weight.dtype)
    for rows in range(LEAST_ROWS, most_rows(0) + 1):
        try:
            ours, theirs = matmul(x[:rows], weight), x[:rows] @ weight.T
            # Apart from rounding: the sums are taken in another order.
            atol = mx.abs(theirs).max().item() / 64
            same = mx.allclose(ours, theirs, rtol=1 / 64, atol=atol).item()
        # (not built here: an architecture this mlx's NVRTC cannot target, say)
        except (RuntimeError, ValueError) as exc:
            log.warning("few-row products left to mlx: the kernel failed at %d rows (%s)",
                        rows, exc)  # fmt: skip
            return 0
        if not same:
            log.warning("few-row products left to mlx: this GPU's differed from mlx's at %d rows",
                        rows)  # fmt: skip
            return 0
    for layer in layers:
        layer.__class__ = FewRowsLinear
        layer.most = most_rows(layer["weight"].size)
    return len(layers)
