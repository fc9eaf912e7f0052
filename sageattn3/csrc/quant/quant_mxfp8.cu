// Smoothing + MXFP8 along D for the FP8 Q.K^T path (reference.quantize_mxfp8_rows of the same
// smoothed rows the NVFP4 quantizer takes), only for the heads that use it.
//
// Row r of head h (x (H, S, D), heads flattened over the batch) becomes
//   y = x[h, r] * 2^(sign * e[h / rep]) - mean[h, m(r)]      (fp32, the balance optional)
// with m(r) = r / 128 when mean has more than one row per head, else 0; then, per 32 values:
// amax, the UE8M0 byte b = E(amax) - 8 + (frac(amax) > 0.75) clamped to >= 1 (the smallest 2^(b-127)
// with amax <= 448 * 2^(b-127)), and each value times 2^(127-b) (exact), clamped to +-448 and
// converted to E4M3 (round to nearest even). Rows S..Sp-1 get zero codes and scale byte 1, as the
// reference gives zero rows. A head whose sel byte has bit 0 clear, or bit 2 set (Q's heads that
// multiply the raw 16-bit rows instead; bit 1, FP8 P.V, is not Q's or K's), is skipped entirely
// (its outputs are left as they are): the launch is made for every call of
// the "auto" path, and costs next to nothing
// where the rule chose FP4 everywhere (each block reads its head's byte first). One thread per
// 32-value block; grid (head, blocks over the head's rows).
//
// With the rotation (rotate, D 64/128; reference.preprocess with qk_fp8_rotated): the row is
// balanced, then rotated (preprocess/rotation.cuh, as the NVFP4 smoothing rotates it), then the
// mean (balanced and rotated already, as the preprocessing wrote it) is subtracted on real rows;
// padding rows stay zeros. Without the preprocessing's rotation (rotate_mean;
// reference.fp8_rows) the mean row is unrotated and rotated here by the same butterflies, and
// Q's rows are then multiplied by 64/D (row_scale, exact) to keep Q8 . K8^T in the unrotated
// units. A row's D/16 16-value blocks sit in consecutive lanes (the rotation's
// layout), a warp takes 32 / (D/16) rows at a time, and the two lanes of a 32-value block share
// its amax (and whether it holds a NaN) through one shuffle.
//
// bf16_out (the 16-bit Q.K^T rows, reference.qk16_rows): the same fp32 values rounded to bf16
// (nearest even) instead of MXFP8, no scales; padding rows +0. A NaN stays a NaN (the canonical
// 0x7FFF here; torch's conversion may keep another NaN's bits).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/launch.cuh"
#include "common/mxfp8.cuh"
#include "common/nvfp4.cuh"
#include "preprocess/rotation.cuh"
#include "quant/mxfp8_cols.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kThreads = 256;
static_assert(kThreads == mxfp8_cols::kThreads, "V's tiles take the rows' blocks");

template <typename T>
__device__ __forceinline__ float load_value(const T* p, int i);
template <>
__device__ __forceinline__ float load_value<bf16_t>(const bf16_t* p, int i) {
  return __uint_as_float(static_cast<uint32_t>(p[i].bits) << 16);
}
template <>
__device__ __forceinline__ float load_value<f16_t>(const f16_t* p, int i) {
  return __half2float(__ushort_as_half(p[i].bits));
}
template <>
__device__ __forceinline__ float load_value<float>(const float* p, int i) {
  return p[i];
}

// 8 values -> 8 bf16 (round to nearest even), element 0 in the low half of the first word.
__device__ __forceinline__ uint4 bf16x8(const float* v) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
    w[j] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Two row sets in one launch (Q's and K's): grid columns below first.H take first's heads, the
// next second.H second's; with kCols the columns after those take V's tiles (cols, `tiles` of
// them: s_tiles along the sequence, then d_tiles, then the groups), gridDim.y tiles a column.
struct Mxfp8Pair {
  Mxfp8Args first, second;
  Mxfp8ColsArgs cols;
  int64_t s_tiles, d_tiles, tiles;
};

// A block of V's tiles (kCols): quant_mxfp8_cols' tile (quant/mxfp8_cols.cuh).
template <typename T>
__device__ __forceinline__ void cols_block(const Mxfp8Pair& pair) {
  __shared__ __align__(16) uint32_t tile[mxfp8_cols::kTS][mxfp8_cols::kWords];
  const int64_t i = (static_cast<int64_t>(blockIdx.x) - pair.first.H - pair.second.H) * gridDim.y + blockIdx.y;
  if (i >= pair.tiles) return;  // the whole block
  const Mxfp8ColsArgs& c = pair.cols;
  const int64_t per_group = pair.s_tiles * pair.d_tiles, r = i % per_group;
  mxfp8_cols::cols_tile<T>(static_cast<const T*>(c.x), c.S, c.D, c.Sp, c.codes, c.scales, c.sel, r % pair.s_tiles,
                           r / pair.s_tiles, i / per_group, tile);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) mxfp8_kernel(Mxfp8Pair pair) {
  const bool one = blockIdx.x < pair.first.H;
  const Mxfp8Args a = one ? pair.first : pair.second;
  const int64_t blocks_per_row = a.D / 32;
  // one head per grid column: a skipped head costs its blocks one byte read
  const int64_t h = one ? blockIdx.x : blockIdx.x - pair.first.H;
  if (a.sel != nullptr && (a.sel[h] & 5) != 1) return;
  const int64_t n = a.Sp * blocks_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.y) * kThreads) {
    const int64_t blk = i % blocks_per_row;
    const int64_t row = i / blocks_per_row;
    const int64_t width = a.bf16_out ? 2 : 1;  // bytes per value
    uint8_t* out = a.codes + ((h * a.Sp + row) * a.D + blk * 32) * width;
    uint8_t* sf = a.bf16_out ? nullptr : a.scales + (h * a.Sp + row) * blocks_per_row + blk;
    if (row >= a.S) {
      const uint4 z = make_uint4(0u, 0u, 0u, 0u);
      if (a.bf16_out) {
#pragma unroll
        for (int j = 0; j < 4; ++j) reinterpret_cast<uint4*>(out)[j] = z;
        continue;
      }
      reinterpret_cast<uint4*>(out)[0] = z;
      reinterpret_cast<uint4*>(out)[1] = z;
      *sf = 1;
      continue;
    }
    const T* x = static_cast<const T*>(a.x) + (h * a.S + row) * a.D + blk * 32;
    const int64_t m = a.mean_rows > 1 ? row / 128 : 0;
    const float* mean = a.mean + (h * a.mean_rows + m) * a.D + blk * 32;
    const float* bal = a.balance == nullptr ? nullptr : a.balance + (h / a.rep) * a.D + blk * 32;
    float v[32];
    float amax = 0.f;
    bool nan = false;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      float x0 = load_value<T>(x, j);
      if (bal != nullptr) x0 = __fmul_rn(x0, ldexpf(1.f, a.balance_sign * static_cast<int>(bal[j])));
      v[j] = __fsub_rn(x0, mean[j]);
      amax = fmaxf(amax, fabsf(v[j]));
      nan |= v[j] != v[j];
    }
    if (a.bf16_out) {
#pragma unroll
      for (int j = 0; j < 4; ++j) reinterpret_cast<uint4*>(out)[j] = bf16x8(v + 8 * j);
      continue;
    }
    const uint32_t b = ue8m0_byte(amax, nan);  // common/mxfp8.cuh
    const float inv = ue8m0_inverse(b);
    uint32_t w[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = e4m3x4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3], inv);
    reinterpret_cast<uint4*>(out)[0] = make_uint4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<uint4*>(out)[1] = make_uint4(w[4], w[5], w[6], w[7]);
    *sf = static_cast<uint8_t>(b);
  }
}

// Head h of the row set a (at D 128 a kernel parameter: each call site reads its own set's fields
// from the constant bank, rather than a copy selected at run time).
template <typename T, int kD>
__device__ __forceinline__ void rotated_rows(const Mxfp8Args& a, int64_t h) {
  constexpr int kBpr = kD / 16, kRows = 32 / kBpr, kWarps = kThreads / 32;
  if (a.sel != nullptr && (a.sel[h] & 5) != 1) return;
  const int lane = threadIdx.x & 31, cb = lane % kBpr;
  const int64_t groups = ceil_div(a.Sp, kRows);
  // warp-uniform bounds: every lane of a warp takes part in the rotation's shuffles
  for (int64_t gi = static_cast<int64_t>(blockIdx.y) * kWarps + (threadIdx.x >> 5); gi < groups;
       gi += static_cast<int64_t>(gridDim.y) * kWarps) {
    const int64_t row = gi * kRows + lane / kBpr;
    const bool real = row < a.S;
    float v[16];
    if (real) {
      const T* x = static_cast<const T*>(a.x) + (h * a.S + row) * kD + cb * 16;
      const float* bal = a.balance == nullptr ? nullptr : a.balance + (h / a.rep) * kD + cb * 16;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float x0 = load_value<T>(x, j);
        v[j] = bal == nullptr ? x0 : __fmul_rn(x0, ldexpf(1.f, a.balance_sign * static_cast<int>(bal[j])));
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = 0.f;
    }
    rotate_block<kBpr>(v, cb);
    float mean[16];
    if (real) {
      const int64_t m = a.mean_rows > 1 ? row / 128 : 0;
      const float* mp = a.mean + (h * a.mean_rows + m) * kD + cb * 16;
#pragma unroll
      for (int j = 0; j < 16; ++j) mean[j] = mp[j];
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) mean[j] = 0.f;
    }
    if (a.rotate_mean) rotate_block<kBpr>(mean, cb);  // warp-uniform: every lane shuffles
    float amax = 0.f;
    bool nan = false;
    if (real) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        v[j] = __fmul_rn(__fsub_rn(v[j], mean[j]), a.row_scale);
        amax = fmaxf(amax, fabsf(v[j]));
        nan |= v[j] != v[j];
      }
    } else {
      // padding rows are +0 (the reference pads the smoothed rows with zeros); the rotation's
      // signs would have made some of them -0, which E4M3 keeps (0x80)
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = 0.f;
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // the other half of the 32-value block
    nan = __shfl_xor_sync(0xffffffffu, static_cast<int>(nan), 1) != 0 || nan;
    if (row >= a.Sp) continue;
    if (a.bf16_out) {
      uint4* dst = reinterpret_cast<uint4*>(a.codes + ((h * a.Sp + row) * kD + cb * 16) * 2);
      dst[0] = bf16x8(v);
      dst[1] = bf16x8(v + 8);
      continue;
    }
    const uint32_t b = ue8m0_byte(amax, nan);
    const float inv = ue8m0_inverse(b);
    reinterpret_cast<uint4*>(a.codes + (h * a.Sp + row) * kD)[cb] = e4m3_codes16(v, inv);
    if ((cb & 1) == 0) a.scales[(h * a.Sp + row) * (kD / 32) + cb / 2] = static_cast<uint8_t>(b);
  }
}

template <typename T, int kD, bool kCols>
__global__ void __launch_bounds__(kThreads) mxfp8_rotated_kernel(const Mxfp8Pair pair) {
  if constexpr (kCols) {
    if (blockIdx.x >= pair.first.H + pair.second.H) return cols_block<T>(pair);
  }
  const bool one = blockIdx.x < pair.first.H;
  const int64_t h = one ? blockIdx.x : blockIdx.x - pair.first.H;
  if constexpr (kD == 128) {
    // two copies of the row loop, one per set (Q's, K's): 1,121 warp-instructions per iteration
    // against 1,142 for one loop over a set picked at run time (sm_120a, nvcc 13.0)
    if (one) rotated_rows<T, kD>(pair.first, h);
    else rotated_rows<T, kD>(pair.second, h);
  } else {
    // at D 64 (bf16 rows) the copies cost more than they save: 1,031 and 1,043 against 1,024
    const Mxfp8Args a = one ? pair.first : pair.second;
    rotated_rows<T, kD>(a, h);
  }
}

// Grid rows per head: enough for the head's rows, about 8 blocks per SM over all heads.
int64_t grid_rows(const Mxfp8Args& a, int64_t heads) {
  if (a.H == 0) return 0;
  const int64_t per_head = std::max<int64_t>(1, static_cast<int64_t>(sm_count()) * 8 / heads);
  const int64_t work = a.rotate ? ceil_div(ceil_div(a.Sp, a.D == 64 ? 8 : 4), kThreads / 32)  // rows per warp
                                : ceil_div(a.Sp * (a.D / 32), static_cast<int64_t>(kThreads));
  return std::min<int64_t>({work, per_head, 65535});
}

template <typename T, bool kCols>
int launch(const Mxfp8Pair& pair, cudaStream_t stream) {
  const int64_t heads = pair.first.H + pair.second.H;
  const int64_t gy = std::max(grid_rows(pair.first, heads), grid_rows(pair.second, heads));
  if (gy == 0) return cudaSuccess;
  const int64_t columns = heads + (kCols ? ceil_div(pair.tiles, gy) : 0);
  if (columns > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(columns), static_cast<unsigned>(gy));
  // V's tiles ride with rotated rows only (the FP8 Q.K^T rows always are: attention_call)
  if (!pair.first.rotate) {
    if constexpr (kCols) return cudaErrorInvalidValue;
    else mxfp8_kernel<T><<<grid, kThreads, 0, stream>>>(pair);
  } else if (pair.first.D == 64) mxfp8_rotated_kernel<T, 64, kCols><<<grid, kThreads, 0, stream>>>(pair);
  else mxfp8_rotated_kernel<T, 128, kCols><<<grid, kThreads, 0, stream>>>(pair);
  return cudaGetLastError();
}

template <typename T>
int launch(const Mxfp8Pair& pair, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, float>) {
    return pair.tiles > 0 ? cudaErrorInvalidValue : launch<T, false>(pair, stream);  // V is 16-bit
  } else {
    return pair.tiles > 0 ? launch<T, true>(pair, stream) : launch<T, false>(pair, stream);
  }
}

// V's tiles as quant_mxfp8_cols makes them (its checks: mxfp8_cols::args_fit), into pair; false if
// cols is invalid. No tiles (G or Sp 0): nothing to add.
bool with_cols(const Mxfp8ColsArgs& c, Mxfp8Pair& pair) {
  if (!mxfp8_cols::args_fit(c.G, c.S, c.D, c.Sp)) return false;
  if (c.G == 0 || c.Sp == 0) return true;
  if (c.x == nullptr || c.codes == nullptr || c.scales == nullptr) return false;
  pair.cols = c;
  pair.s_tiles = ceil_div(c.Sp, static_cast<int64_t>(mxfp8_cols::kTS));
  pair.d_tiles = ceil_div(c.D, static_cast<int64_t>(mxfp8_cols::kTC));
  pair.tiles = pair.s_tiles * pair.d_tiles * c.G;
  return true;
}

bool valid(const Mxfp8Args& a) {
  return !(a.D <= 0 || a.D % 32 || a.S < 1 || a.Sp < a.S || a.H < 1 || a.mean_rows < 1 || a.rep < 1 ||
           (a.mean_rows > 1 && a.mean_rows * 128 < a.S) || (a.rotate && !rotation_applies(static_cast<int>(a.D))) ||
           (!a.rotate && a.rotate_mean) || (a.row_scale != 1.f && !a.rotate_mean) || !(a.row_scale > 0.f));
}

}  // namespace

int smooth_quant_mxfp8_pair(const Mxfp8Args& first, const Mxfp8Args& second, cudaStream_t stream,
                            const Mxfp8ColsArgs* cols) {
  const bool two = second.H > 0;
  if (!valid(first) || (two && (!valid(second) || second.dtype != first.dtype || second.D != first.D ||
                                second.rotate != first.rotate || second.bf16_out != first.bf16_out)) ||
      first.H + second.H > 0x7FFFFFFF)
    return cudaErrorInvalidValue;
  Mxfp8Pair pair{first, second, Mxfp8ColsArgs{}, 0, 0, 0};
  if (!two) pair.second.H = 0;
  if (cols != nullptr && !with_cols(*cols, pair)) return cudaErrorInvalidValue;
  switch (first.dtype) {
    case DType::kFloat16: return launch<f16_t>(pair, stream);
    case DType::kBFloat16: return launch<bf16_t>(pair, stream);
    case DType::kFloat32: return launch<float>(pair, stream);
  }
  return cudaErrorInvalidValue;
}

int smooth_quant_mxfp8(const Mxfp8Args& a, cudaStream_t stream) { return smooth_quant_mxfp8_pair(a, Mxfp8Args{}, stream); }

}  // namespace sageattn3
