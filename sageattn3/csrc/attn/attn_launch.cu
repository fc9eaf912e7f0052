// Host side of the FP4 attention: argument checks, TMA descriptors, grid size, delta_s's precompute
// and the one launch site of the attention kernel.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <mutex>
#include <numeric>

#include "attn/attn_api.h"
#include "attn/attn_fwd_kernel.cuh"
#include "attn/delta_s_blocks.cuh"
#include "common/launch.cuh"

namespace sageattn3 {
namespace attn {

// The single kernel entry point, three instantiations per head dim: kInLoopResidual false reads
// delta_s rows (one Q mean: ds_key; per-block Q means: delta_s precomputed per query block and
// key by delta_s_blocks_kernel), true corrects ds_key by r . K^ per key tile in its loop (per-block
// Q means without a workspace for delta_s: the bounded-memory mode); kQK8 computes Q.K^T from the
// MXFP8 operands (the heads the per-head precision picked; delta_s read as without kInLoopResidual).
// kPV8 (pv_precision "fp8", with either Q.K^T; delta_s rows only) computes P.V in MXFP8. kQK16
// (with kQK8) takes the selected heads' Q.K^T from 16-bit rows instead of MXFP8: at D 64 bf16 rows
// (Fp4AttnArgs.qk16), at D 128 the raw inputs (Fp4AttnArgs.q_raw; 1 bf16, 2 fp16).
template <int D, bool kInLoopResidual, bool kQK8 = false, bool kPV8 = false, int kQK16 = 0>
__global__ void __launch_bounds__(kCtaThreads<kInLoopResidual>, 1) fp4_attn_fwd_kernel(const __grid_constant__ AttnParams p) {
  attn_fwd_body<D, kInLoopResidual, kQK8, kPV8, kQK16>(p);
}

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) ==
            cudaSuccess &&
        status == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  });
  return fn;
}

CUtensorMapSwizzle swizzle_for(int row_bytes) {
  return row_bytes == 32 ? CU_TENSOR_MAP_SWIZZLE_32B : row_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B;
}

// A 2D map over `rows` rows of `cols` elements (row stride = cols), box box_cols x box_rows.
bool make_map(CUtensorMap* map, const void* base, CUtensorMapDataType type, int elem_bytes, uint64_t cols,
              uint64_t rows, uint32_t box_cols, uint32_t box_rows, CUtensorMapSwizzle swizzle) {
  auto fn = encode_fn();
  if (!fn) return false;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * elem_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  return fn(map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

// A CTA walks the tiles i, i + grid, ... and a tile's head is tile % bh_count, so where grid and
// bh_count share a factor f a head's tiles reach only grid / f of the CTAs (one head of 24 on 132
// CTAs: 11 CTAs, 24 of its 256 tiles each at 32k tokens). A launch that computes only some heads
// (the FP8 one of the per-head precision) takes the largest grid coprime with bh_count instead:
// every head's tiles then spread over all of its CTAs, for a few idle ones at most.
int coprime_grid(int grid, int bh_count) {
  for (int g = grid; g > 1; --g)
    if (std::gcd(g, bh_count) == 1) return g;
  return 1;
}

template <int D, bool kInLoopResidual, bool kQK8 = false, bool kPV8 = false, int kQK16 = 0>
int launch_attn(AttnParams& p, int sms, cudaStream_t stream, bool spread_heads = false) {
  using L = SmemLayout<D, kQK8, kPV8, kQK16>;
  static_assert(L::kTotal <= 99 * 1024, "sm_120's shared memory per CTA");
  auto kernel = fp4_attn_fwd_kernel<D, kInLoopResidual, kQK8, kPV8, kQK16>;
  static KernelSetup setup;  // this instantiation's shared-memory ceiling and occupancy, per device
  cudaError_t err = setup.smem(kernel, L::kTotal);
  if (err != cudaSuccess) return err;
  int per_sm = 0;
  err = setup.blocks_per_sm(&per_sm, kernel, kCtaThreads<kInLoopResidual>, L::kTotal);
  if (err != cudaSuccess) return err;
  p.num_tiles = p.bh_count * p.num_m_blocks;
  int grid = std::max(1, std::min(p.num_tiles, sms * std::max(per_sm, 1)));
  if (spread_heads && grid < p.num_tiles) grid = coprime_grid(grid, p.bh_count);
  // The launch site of the attention kernel (see attn_params.h for why it matters).
  kernel<<<grid, kCtaThreads<kInLoopResidual>, L::kTotal, stream>>>(p);
  return cudaGetLastError();
}

// dst computes src's (batch, q head) rows (the chunk of the workspace), tiles whose byte is `want`.
void same_rows(AttnParams& dst, const AttnParams& src, int want) {
  dst.bh0 = src.bh0;
  dst.bh_count = src.bh_count;
  dst.ds_key = src.ds_key;
  dst.ds_bh_stride = src.ds_bh_stride;
  dst.ds_m_stride = src.ds_m_stride;
  dst.head_sel_want = want;
}

// Both precisions per head (v8_by_head): four launches over p's rows, one per head_sel byte value
// (bit 0 FP8 Q.K^T, bit 1 FP8 P.V): p (FP4/FP4, its grid as the plain FP4 path), p8 (the MXFP8 Q/K
// maps), pv (V's MXFP8 map) and p8v (both). The three that compute the heads the rule picked spread
// them; a launch with no such head only walks the selection bytes. Delta_s rows only. kQK16: p8
// and p8v have the bf16 Q/K maps, and bit 0's heads take the 16-bit Q.K^T kernels.
template <int D, int kQK16 = 0>
int launch_mixed(AttnParams& p, AttnParams& p8, AttnParams& pv, AttnParams& p8v, int sms, cudaStream_t stream) {
  p.head_sel_want = 0;
  int rc = launch_attn<D, false, false, false>(p, sms, stream);
  same_rows(p8, p, 1);
  if (rc == cudaSuccess) rc = launch_attn<D, false, true, false, kQK16>(p8, sms, stream, /*spread_heads=*/true);
  same_rows(pv, p, 2);
  if (rc == cudaSuccess) rc = launch_attn<D, false, false, true>(pv, sms, stream, /*spread_heads=*/true);
  same_rows(p8v, p, 3);
  if (rc == cudaSuccess) rc = launch_attn<D, false, true, true, kQK16>(p8v, sms, stream, /*spread_heads=*/true);
  return rc;
}

// One attention launch over p's (batch, q head) rows: the FP4 kernel for every tile, or, with the
// per-head precision (p8: p with the MXFP8 Q/K maps), the FP4 kernel for the tiles whose head_sel
// byte is 0 and the FP8 one for those whose byte is 1 (each skips the other's tiles on the device).
// kPV8: the FP8 P.V kernels (p's V map and scales are V's MXFP8), which read delta_s rows only.
template <int D, bool kInLoopResidual, bool kPV8 = false, int kQK16 = 0>
int launch_both(AttnParams& p, AttnParams* p8, int sms, cudaStream_t stream) {
  if constexpr (kPV8 && kInLoopResidual) {
    return cudaErrorInvalidValue;  // no bounded-memory FP8 P.V kernel
  } else {
    if (p8 == nullptr) return launch_attn<D, kInLoopResidual, false, kPV8>(p, sms, stream);
    if (kInLoopResidual) return cudaErrorInvalidValue;  // the FP8 kernel reads precomputed delta_s rows only
    p.head_sel_want = 0;
    int rc = launch_attn<D, kInLoopResidual, false, kPV8>(p, sms, stream);
    if (rc != cudaSuccess) return rc;
    same_rows(*p8, p, 1);
    // The FP4 launch keeps its grid (where no head takes FP8 its work is exactly the FP4 path's);
    // the FP8 one, usually a few heads, spreads them.
    return launch_attn<D, false, true, kPV8, kQK16>(*p8, sms, stream, /*spread_heads=*/true);
  }
}

// p8 (a copy of p) gets the Q and K maps of the heads that leave FP4: with a.qk16 (always at D 64)
// the bf16 rows, 2D bytes per row and no scales (the FP4 scale maps stay, unused), a box a part of
// the row wide (SmemLayout::kParts: the whole row at D 64, a quarter at D 128); else the MXFP8
// codes, D bytes per row, and their UE8M0 bytes, one per 32 values. False if a map fails.
template <int D>
bool precise_maps(const Fp4AttnArgs& a, uint64_t bq, uint64_t bk, AttnParams& p8) {
  bool ok = true;
  if (a.qk16) {
    ok &= make_map(&p8.tm_q, a.q8, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 2 * D, bq * a.seq_q_pad, 2 * D, kBlockM,
                   swizzle_for(2 * D));
    ok &= make_map(&p8.tm_k, a.k8, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 2 * D, bk * a.seq_k_pad, 2 * D, kBlockN,
                   swizzle_for(2 * D));
    return ok;
  }
  ok &= make_map(&p8.tm_q, a.q8, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, D, bq * a.seq_q_pad, D, kBlockM, swizzle_for(D));
  ok &= make_map(&p8.tm_q_sf, a.q8_sf, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 128, bq * a.seq_q_pad * (D / 32) / 128, 128,
                 kBlockM * (D / 32) / 128, CU_TENSOR_MAP_SWIZZLE_NONE);
  ok &= make_map(&p8.tm_k, a.k8, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, D, bk * a.seq_k_pad, D, kBlockN, swizzle_for(D));
  ok &= make_map(&p8.tm_k_sf, a.k8_sf, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 128, bk * a.seq_k_pad * (D / 32) / 128, 128,
                 kBlockN * (D / 32) / 128, CU_TENSOR_MAP_SWIZZLE_NONE);
  return ok;
}

// p16 (a copy of p8) gets the raw 16-bit rows' maps (Fp4AttnArgs.q_raw; D 128): the inputs' rows,
// 2D bytes each, a box of a part of the row (SmemLayout::kParts) by 128 rows; and its softmax scale.
// False if a map fails.
template <int D>
bool raw_maps(const Fp4AttnArgs& a, uint64_t bq, uint64_t bk, AttnParams& p16) {
  constexpr uint32_t kBox = SmemLayout<D, true, false, 1>::kRowBytes;
  bool ok = make_map(&p16.tm_q, a.q_raw, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 2 * D, bq * a.seq_q, kBox, kBlockM,
                     swizzle_for(kBox));
  ok &= make_map(&p16.tm_k, a.k_raw, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 2 * D, bk * a.seq_k, kBox, kBlockN,
                 swizzle_for(kBox));
  p16.scale_log2 = a.raw_sm_scale * 1.4426950408889634f;
  return ok;
}

// The raw 16-bit Q.K^T's launches over p's rows (Fp4AttnArgs.q_raw): byte 5 (FP4 P.V, or every
// head's P.V with a call-wide FP8 P.V: kPV8) from p16, and with v8_by_head byte 7 from p16v.
template <int D, int kQK16>
int launch_raw(const Fp4AttnArgs& a, const AttnParams& p, AttnParams& p16, AttnParams& p16v, bool pv8, int sms,
               cudaStream_t stream) {
  same_rows(p16, p, 5);
  int rc = pv8 ? launch_attn<D, false, true, true, kQK16>(p16, sms, stream, /*spread_heads=*/true)
               : launch_attn<D, false, true, false, kQK16>(p16, sms, stream, /*spread_heads=*/true);
  if (rc == cudaSuccess && a.v8_by_head) {
    same_rows(p16v, p, 7);
    rc = launch_attn<D, false, true, true, kQK16>(p16v, sms, stream, /*spread_heads=*/true);
  }
  return rc;
}

// Every launch over p's (batch, q head) rows: the FP4 kernel, or with the per-head precision (p8)
// each byte value's. The heads that leave FP4 take the 16-bit Q.K^T at D 64 (a.qk16: no MXFP8 Q.K^T
// kernel there), MXFP8 Q.K^T at D 128, and there those with bit 2 the raw 16-bit rows (launch_raw).
// in_loop: the bounded mode (FP4 only).
template <int D>
int launch_rows(const Fp4AttnArgs& a, AttnParams& p, AttnParams* p8, AttnParams& pv, AttnParams& p8v,
                AttnParams& p16, AttnParams& p16v, bool pv8, bool in_loop, int sms, cudaStream_t stream) {
  constexpr int kK16 = D == 64 ? 1 : 0;
  int rc;
  if (a.v8_by_head) {
    rc = in_loop ? cudaErrorInvalidValue : launch_mixed<D, kK16>(p, *p8, pv, p8v, sms, stream);
  } else if (pv8) {
    rc = in_loop ? cudaErrorInvalidValue : launch_both<D, false, true, kK16>(p, p8, sms, stream);
  } else {
    rc = in_loop ? launch_both<D, true, false, kK16>(p, p8, sms, stream)
                 : launch_both<D, false, false, kK16>(p, p8, sms, stream);
  }
  if constexpr (D == 128) {
    if (rc == cudaSuccess && a.q_raw != nullptr)
      rc = a.raw_f16 ? launch_raw<D, 2>(a, p, p16, p16v, pv8, sms, stream)
                     : launch_raw<D, 1>(a, p, p16, p16v, pv8, sms, stream);
  }
  return rc;
}

// pv and p8v (copies of p and of p8) get V's MXFP8 map and scales (v8_by_head); false if the map fails.
template <int D>
bool with_v8(const Fp4AttnArgs& a, uint64_t bk, AttnParams& pv, AttnParams& p8v) {
  if (!make_map(&pv.tm_v, a.v8, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, a.seq_k_pad, bk * D, kBlockN, D, swizzle_for(kBlockN)))
    return false;
  pv.v_sf = static_cast<const uint8_t*>(a.v8_sf);
  pv.v_exp = nullptr;
  p8v.tm_v = pv.tm_v;
  p8v.v_sf = pv.v_sf;
  p8v.v_exp = nullptr;
  return true;
}

template <int D>
int launch(const Fp4AttnArgs& a, cudaStream_t stream) {
  using L = SmemLayout<D>;
  AttnParams p{};
  const uint64_t bq = static_cast<uint64_t>(a.batch) * a.heads_q, bk = static_cast<uint64_t>(a.batch) * a.heads_kv;
  bool ok = true;
  ok &= make_map(&p.tm_q, a.q, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, D / 2, bq * a.seq_q_pad, D / 2, kBlockM,
                 swizzle_for(D / 2));
  ok &= make_map(&p.tm_q_sf, a.q_sf, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 128, bq * a.seq_q_pad * (D / 16) / 128, 128,
                 kBlockM * (D / 16) / 128, CU_TENSOR_MAP_SWIZZLE_NONE);
  ok &= make_map(&p.tm_k, a.k, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, D / 2, bk * a.seq_k_pad, D / 2, kBlockN,
                 swizzle_for(D / 2));
  ok &= make_map(&p.tm_k_sf, a.k_sf, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 128, bk * a.seq_k_pad * (D / 16) / 128, 128,
                 kBlockN * (D / 16) / 128, CU_TENSOR_MAP_SWIZZLE_NONE);
  const bool pv8 = a.v8 != nullptr && !a.v8_by_head;  // V in MXFP8: (B*Hkv*D rows, Sk_pad bytes), box 128 x D
  ok &= pv8 ? make_map(&p.tm_v, a.v8, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, a.seq_k_pad, bk * D, kBlockN, D,
                       swizzle_for(kBlockN))
            : make_map(&p.tm_v, a.v, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, a.seq_k_pad / 2, bk * D, kBlockN / 2, D,
                       swizzle_for(kBlockN / 2));
  if (!ok) return cudaErrorInvalidValue;
  p.v_sf = static_cast<const uint8_t*>(pv8 ? a.v8_sf : a.v_sf);
  p.v_exp = pv8 ? nullptr : a.v_exp;
  p.mean_q = a.mean_q;
  p.qbar = a.qbar;
  p.ds_key = a.ds_key;
  p.k_res = static_cast<const uint8_t*>(a.k_res);
  p.out = a.out;
  p.batch = a.batch;
  p.heads_q = a.heads_q;
  p.heads_kv = a.heads_kv;
  p.seq_q = a.seq_q;
  p.seq_k = a.seq_k;
  p.seq_q_pad = a.seq_q_pad;
  p.seq_k_pad = a.seq_k_pad;
  p.mean_qblocks = a.mean_qblocks;
  p.num_m_blocks = (a.seq_q + kBlockM - 1) / kBlockM;
  p.scale_log2 = a.sm_scale * 1.4426950408889634f;
  p.causal = a.causal ? 1 : 0;
  p.out_bf16 = a.out_dtype == DType::kBFloat16 ? 1 : 0;
  p.bh0 = 0;
  p.bh_count = static_cast<int>(bq);
  p.ds_bh_stride = a.seq_k_pad;
  p.ds_m_stride = 0;
  p.head_sel = a.head_sel;
  p.head_sel_want = 0;
  AttnParams p8_store = p;
  AttnParams* p8 = nullptr;
  if (a.head_sel != nullptr) {
    if (!precise_maps<D>(a, bq, bk, p8_store)) return cudaErrorInvalidValue;
    p8 = &p8_store;
  }

  // both precisions per head: the FP8 P.V launches' copies with V's MXFP8 map
  AttnParams pv_store = p, p8v_store = p8_store;
  if (a.v8_by_head && (p8 == nullptr || !with_v8<D>(a, bk, pv_store, p8v_store))) return cudaErrorInvalidValue;
  // the raw 16-bit Q.K^T's copies (D 128, bit 2): p8's, then the raw maps; p16v with V's MXFP8 too
  AttnParams p16_store = p8_store, p16v_store = p8v_store;
  if (a.q_raw != nullptr && (!raw_maps<D>(a, bq, bk, p16_store) || !raw_maps<D>(a, bq, bk, p16v_store)))
    return cudaErrorInvalidValue;

  const int sms = sm_count();
  auto both = [&](bool in_loop) {
    return launch_rows<D>(a, p, p8, pv_store, p8v_store, p16_store, p16v_store, pv8, in_loop, sms, stream);
  };
  if (a.mean_qblocks == 1) return both(false);

  // Per-block Q means: delta_s per query block and key, precomputed into the caller's workspace
  // in chunks of (batch, q head) rows that fit it; without one (or too small for one row), the
  // kernel corrects ds_key in its loop (the bounded-memory mode). Both give the same delta_s.
  const int64_t row_floats = static_cast<int64_t>(p.num_m_blocks) * a.seq_k_pad;
  // at most 65535 rows per chunk: the precompute's grid.y
  const int64_t rows = a.ds_work == nullptr ? 0
      : std::min<int64_t>(std::min<int64_t>(static_cast<int64_t>(bq), a.ds_work_floats / row_floats), 65535);
  if (rows < 1) return both(true);
  const int chunk = static_cast<int>(rows);
  float* ws = a.ds_work;
  // At D 64 the precompute stores a thread's two keys at once (8 bytes): a workspace only 4-byte
  // aligned takes its two-store copy.
  const bool pair_store = attn::aligned(ws, 8);
  DeltaSBlocksParams dp{};
  dp.k = static_cast<const uint8_t*>(a.k);
  dp.k_sf = static_cast<const uint8_t*>(a.k_sf);
  dp.k_res = static_cast<const uint8_t*>(a.k_res);
  dp.mean_q = a.mean_q;
  dp.qbar = a.qbar;
  dp.ds_key = a.ds_key;
  dp.out = ws;
  dp.heads_q = a.heads_q;
  dp.heads_kv = a.heads_kv;
  dp.mean_qblocks = a.mean_qblocks;
  dp.seq_k = a.seq_k;
  dp.seq_k_pad = a.seq_k_pad;
  dp.num_m_blocks = p.num_m_blocks;
  dp.causal = p.causal;
  int rc = cudaSuccess;
  for (int bh0 = 0; bh0 < static_cast<int>(bq) && rc == cudaSuccess; bh0 += chunk) {
    const int n = std::min(chunk, static_cast<int>(bq) - bh0);
    dp.bh0 = bh0;
    const dim3 grid((a.seq_k + kBlockN - 1) / kBlockN, n, (p.num_m_blocks + kDeltaMGroup - 1) / kDeltaMGroup);
    auto kernel = delta_s_blocks_kernel<D>;
    if constexpr (D == 64) {
      if (!pair_store) kernel = delta_s_blocks_kernel<D, false>;
    }
    kernel<<<grid, kDeltaThreads<D>, 0, stream>>>(dp);
    rc = cudaGetLastError();
    if (rc != cudaSuccess) break;
    p.bh0 = bh0;
    p.bh_count = n;
    p.ds_key = ws;
    p.ds_bh_stride = static_cast<int64_t>(p.num_m_blocks) * a.seq_k_pad;
    p.ds_m_stride = a.seq_k_pad;
    rc = both(false);
  }
  return rc;
}

}  // namespace
}  // namespace attn

int fp4_attn_fwd(const Fp4AttnArgs& a, cudaStream_t stream) {
  using attn::kBlockM;
  using attn::kBlockN;
  if (a.batch < 1 || a.heads_q < 1 || a.heads_kv < 1 || a.heads_q % a.heads_kv != 0) return cudaErrorInvalidValue;
  if (a.seq_q < 1 || a.seq_k < 1 || a.seq_q_pad % kBlockM || a.seq_k_pad % kBlockN || a.seq_q_pad < a.seq_q ||
      a.seq_k_pad < a.seq_k)
    return cudaErrorInvalidValue;
  if (a.mean_qblocks != 1 && a.mean_qblocks != a.seq_q_pad / kBlockM) return cudaErrorInvalidValue;
  if (a.mean_qblocks != 1 && a.k_res == nullptr) return cudaErrorInvalidValue;  // block means need K's residual
  if (a.out_dtype != DType::kBFloat16 && a.out_dtype != DType::kFloat16) return cudaErrorInvalidValue;
  if (!attn::aligned(a.q, 16) || !attn::aligned(a.k, 16) || !attn::aligned(a.v, 16) || !attn::aligned(a.mean_q, 16) ||
      !attn::aligned(a.qbar, 16) || !attn::aligned(a.ds_key, 4) || !attn::aligned(a.ds_work, 4) || !attn::aligned(a.k_res, 16) ||
      !attn::aligned(a.q_sf, 16) || !attn::aligned(a.k_sf, 16) || !attn::aligned(a.v_sf, 4) || !attn::aligned(a.out, 4))
    return cudaErrorInvalidValue;
  if (a.head_sel != nullptr && (a.q8 == nullptr || a.k8 == nullptr || !attn::aligned(a.q8, 16) || !attn::aligned(a.k8, 16)))
    return cudaErrorInvalidValue;
  if (a.head_sel != nullptr && !a.qk16 && (a.q8_sf == nullptr || a.k8_sf == nullptr || !attn::aligned(a.q8_sf, 16) ||
                                           !attn::aligned(a.k8_sf, 16)))
    return cudaErrorInvalidValue;
  // the selected heads' Q.K^T: 16-bit rows at D 64, MXFP8 at D 128 (and there the raw rows for bit 2)
  if (a.head_sel != nullptr && a.qk16 != (a.head_dim == 64)) return cudaErrorInvalidValue;
  if (a.q_raw != nullptr && (a.head_dim != 128 || a.head_sel == nullptr || a.k_raw == nullptr ||
                             !attn::aligned(a.q_raw, 16) || !attn::aligned(a.k_raw, 16)))
    return cudaErrorInvalidValue;
  if (a.v8 != nullptr && (a.v8_sf == nullptr || !attn::aligned(a.v8, 16) || !attn::aligned(a.v8_sf, 4)))
    return cudaErrorInvalidValue;
  if (a.v8_by_head && (a.v8 == nullptr || a.head_sel == nullptr)) return cudaErrorInvalidValue;
  switch (a.head_dim) {
    case 64: return attn::launch<64>(a, stream);
    case 128: return attn::launch<128>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

int fp4_attn_supported(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return 0;
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  cudaFuncAttributes attr;
  // A kernel image for this device exists iff the attributes can be read.
  if (cudaFuncGetAttributes(&attr, attn::fp4_attn_fwd_kernel<128, false, false>) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
#if defined(SAGEATTN3_MMA_MODEL)
  return major == 9 ? 1 : 0;
#else
  return major == 12 ? 1 : 0;
#endif
}

}  // namespace sageattn3
