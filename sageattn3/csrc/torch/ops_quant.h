// The quantization ops: NVFP4 along rows or along the sequence (csrc/quant/quant_rows.cu,
// quant_cols.cu), the smoothed MXFP8 operands of the FP8 Q.K^T path (csrc/quant/quant_mxfp8.cu)
// and V's MXFP8 for the FP8 P.V path (csrc/quant/quant_mxfp8_cols.cu).
#pragma once

#include <cmath>
#include <cstdint>
#include <tuple>

#include "sageattn3.h"
#include "torch/checks.h"
#include "torch/outputs.h"

namespace sageattn3::torch_ops {

// quant_fp4_rows(x, packed!, scales!): x (..., D) contiguous, D % 16 == 0.
template <class T>
void quant_fp4_rows(T x, T packed, T scales) {
  check_input(x);
  check_codes(packed, scales, x);
  const int64_t cols = x.dim() ? x.size(x.dim() - 1) : 0;
  SA3_CHECK(T, x.dim() >= 1 && cols > 0 && cols % 16 == 0,
            "sageattn3: last dim must be a positive multiple of 16, got x of shape ", shape(x));
  const int64_t n = x.numel();
  SA3_CHECK(T, packed.numel() == n / 2 && scales.numel() == n / 16,
            "sageattn3: output sizes do not match x: expected packed of ", n / 2, " and scales of ", n / 16,
            " elements, got ", packed.numel(), " and ", scales.numel());
  DeviceScope scope(device_index(x));
  check_cuda_kernel<T>(sageattn3::quant_fp4_rows(x.data_ptr(), dtype_of(x, "x"), n, cols, bytes(packed),
                                                 bytes(scales), TensorApi<T>::stream(x)),
                       "quant_fp4_rows");
}


// quant_fp4_cols(x, packed!, scales!, exps!): x (..., S, D) -> packed (..., D, Sp/2), scales (..., D,
// Sp/16); exps empty, or V's tile exponents (..., ceil(Sp/128), D/32) int8 values as uint8 (D a
// multiple of 32): packed and scales are then the NVFP4 of x · 2^e per tile of 128 tokens and 32
// channels (sageattn3.h).
template <class T>
void quant_fp4_cols(T x, T packed, T scales, T exps) {
  check_input(x);
  check_codes(packed, scales, x);
  SA3_CHECK(T, x.dim() >= 2 && packed.dim() >= 2,
            "sageattn3: x must have at least 2 dims, as must packed, got x of shape ", shape(x),
            " and packed of shape ", shape(packed));
  const int64_t S = x.size(x.dim() - 2), D = x.size(x.dim() - 1);
  SA3_CHECK(T, D > 0 && D % 16 == 0, "sageattn3: last dim must be a positive multiple of 16, got ", D);
  const int64_t G = S * D ? x.numel() / (S * D) : 0;
  const int64_t Sp = packed.size(packed.dim() - 1) * 2;
  SA3_CHECK(T, Sp % 16 == 0 && Sp >= S,
            "sageattn3: packed's last dim must be S padded to a multiple of 16, halved, got ", Sp / 2, " for S = ", S);
  SA3_CHECK(T, packed.numel() == G * D * Sp / 2 && scales.numel() == G * D * Sp / 16,
            "sageattn3: output sizes do not match x: expected packed ", dims(G, D, Sp / 2), " and scales ",
            dims(G, D, Sp / 16), " (flattened), got ", shape(packed), " and ", shape(scales));
  const bool with_exps = exps.numel() > 0;
  if (with_exps) {
    check_code_tensor(exps, x, "exps");
    SA3_CHECK(T, D % 32 == 0 && exps.numel() == G * ((Sp + 127) / 128) * (D / 32),
              "sageattn3: exps (V's tile exponents) must be (..., ceil(Sp/128), D/32) = ",
              dims(G, (Sp + 127) / 128, D / 32), " (flattened) with D a multiple of 32, got ", shape(exps),
              " for D = ", D);
  }
  DeviceScope scope(device_index(x));
  check_cuda_kernel<T>(sageattn3::quant_fp4_cols(x.data_ptr(), dtype_of(x, "x"), G, S, D, Sp, bytes(packed),
                                                 bytes(scales),
                                                 with_exps ? reinterpret_cast<int8_t*>(bytes(exps)) : nullptr,
                                                 TensorApi<T>::stream(x)),
                       "quant_fp4_cols");
}

// quant_mxfp8_cols(x, sel, codes!, scales!): V of the FP8 P.V path, x (..., S, D) bf16/fp16 -> codes
// (..., D, Sp) E4M3 bytes, scales (..., D, Sp/32) UE8M0 bytes, Sp >= S a multiple of 32 (the zero
// padding keys), each channel's 32 consecutive tokens sharing one scale. sel: empty (every group)
// or one byte per group (x's leading dims), 0 skips the group (its outputs left as they were).
template <class T>
void quant_mxfp8_cols(T x, T sel, T codes, T scales) {
  check_input(x);
  check_code_tensor(codes, x, "codes");
  check_code_tensor(scales, x, "scales");
  const Kind k = TensorApi<T>::kind(x);
  SA3_CHECK(T, k == Kind::kHalf || k == Kind::kBFloat16, "sageattn3: quant_mxfp8_cols needs x float16 or bfloat16, got ",
            dtype_name(x));
  SA3_CHECK(T, x.dim() >= 2 && codes.dim() >= 2,
            "sageattn3: x must have at least 2 dims, as must codes, got x of shape ", shape(x), " and codes of shape ",
            shape(codes));
  const int64_t S = x.size(x.dim() - 2), D = x.size(x.dim() - 1);
  SA3_CHECK(T, D > 0 && D % 16 == 0, "sageattn3: last dim must be a positive multiple of 16, got ", D);
  const int64_t G = S * D ? x.numel() / (S * D) : 0;
  const int64_t Sp = codes.size(codes.dim() - 1);
  SA3_CHECK(T, Sp % 32 == 0 && Sp >= S,
            "sageattn3: codes' last dim must be S padded to a multiple of 32, got ", Sp, " for S = ", S);
  SA3_CHECK(T, codes.numel() == G * D * Sp && scales.numel() == G * D * Sp / 32,
            "sageattn3: output sizes do not match x: expected codes ", dims(G, D, Sp), " and scales ",
            dims(G, D, Sp / 32), " (flattened), got ", shape(codes), " and ", shape(scales));
  if (sel.numel() > 0) {
    check_code_tensor(sel, x, "sel");
    SA3_CHECK(T, sel.numel() == G, "sageattn3: sel must be empty or hold one byte per group of x (", G, "), got ",
              shape(sel));
  }
  DeviceScope scope(device_index(x));
  check_cuda_kernel<T>(sageattn3::quant_mxfp8_cols(x.data_ptr(), dtype_of(x, "x"), G, S, D, Sp, bytes(codes),
                                                   bytes(scales), sel.numel() > 0 ? bytes(sel) : nullptr,
                                                   TensorApi<T>::stream(x)),
                       "quant_mxfp8_cols");
}

// The launch's arguments from checked operands (mxfp8_smooth_quant's rotate and row_scale).
inline Mxfp8Args mxfp8_fill(const void* x, DType dt, int64_t H, int64_t S, int64_t Sp, int64_t D, const float* mean,
                            int64_t mean_rows, const float* balance, int64_t balance_sign, int64_t rep,
                            const uint8_t* sel, uint8_t* codes, uint8_t* scales, bool bf16_out, int64_t rotate,
                            double row_scale) {
  Mxfp8Args a{};
  a.x = x;
  a.dtype = dt;
  a.H = H;
  a.S = S;
  a.Sp = Sp;
  a.D = D;
  a.mean = mean;
  a.mean_rows = mean_rows;
  a.balance = balance;
  a.balance_sign = balance_sign < 0 ? -1 : 1;
  a.rep = rep;
  a.sel = sel;
  a.codes = codes;
  a.scales = scales;
  a.bf16_out = bf16_out;
  a.rotate = rotate != 0;
  a.rotate_mean = rotate == 2;
  a.row_scale = static_cast<float>(row_scale);
  return a;
}

// mxfp8_smooth_quant(x, mean, balance, balance_sign, sel, codes!, scales!, rotate): x (B, H, S, D),
// mean (B, H, 1 or ceil(S/128), D) fp32, balance (B, Hb, 1, D) fp32 exponents or empty (H a
// multiple of Hb), sel (B, H) bytes or empty; codes (B, H, Sp, D), scales (B, H, Sp, D/32) bytes;
// rotate: 0 none; 1 the rows rotated before the mean, which comes rotated; 2 the mean rotated here
// too (D 64/128 with 1 or 2); row_scale: a power of two the rows are multiplied by after the mean,
// 1 unless rotate is 2 (sageattn3.h, smooth_quant_mxfp8). The 16-bit Q.K^T rows instead (D 64:
// reference.qk16_rows): codes (B, H, Sp, 2D) bytes, the bf16 values, and scales empty.
// Its checks, into the launch's arguments (mxfp8_smooth_quant_qk launches two at once).
template <class T>
Mxfp8Args mxfp8_args(const T& x, const T& mean, const T& balance, int64_t balance_sign, const T& sel, const T& codes,
                     const T& scales, int64_t rotate, double row_scale) {
  check_input(x);
  check_f32_on(mean, x, "mean");
  check_code_tensor(codes, x, "codes");
  check_code_tensor(scales, x, "scales");
  SA3_CHECK(T, x.dim() == 4 && codes.dim() == 4 && mean.dim() == 4, "sageattn3: x, mean and codes must be 4-D, got ",
            x.dim(), ", ", mean.dim(), " and ", codes.dim(), " dims");
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3), Sp = codes.size(2);
  const bool bf16_out = D == 64 && codes.size(3) == 2 * D && scales.numel() == 0;
  SA3_CHECK(T, D % 32 == 0 && S >= 1, "sageattn3: mxfp8_smooth_quant needs D a multiple of 32 and S >= 1, got D ", D,
            " and S ", S);
  SA3_CHECK(T, rotate >= 0 && rotate <= 2, "sageattn3: mxfp8_smooth_quant's rotate must be 0, 1 or 2, got ", rotate);
  SA3_CHECK(T, !rotate || D == 64 || D == 128, "sageattn3: mxfp8_smooth_quant rotates rows of head dim 64 or 128, got ",
            D);
  int row_exp = 0;
  SA3_CHECK(T, row_scale > 0 && std::frexp(row_scale, &row_exp) == 0.5 && row_exp >= -30 && row_exp <= 30 &&
                   (row_scale == 1.0 || rotate == 2),
            "sageattn3: mxfp8_smooth_quant's row_scale must be a power of two from 2^-31 to 2^29, and 1 unless "
            "rotate is 2, got ", row_scale);
  SA3_CHECK(T, codes.size(0) == B && codes.size(1) == H && Sp >= S &&
                   (bf16_out || (codes.size(3) == D && scales.numel() == B * H * Sp * (D / 32))),
            "sageattn3: codes must be (B, H, Sp >= S, D) and scales (B, H, Sp, D/32) for x (", B, ", ", H, ", ", S,
            ", ", D, "), or at D 64 codes (B, H, Sp, 2D) bf16 bytes and scales empty, got codes ", shape(codes),
            " and scales ", shape(scales));
  const int64_t mr = mean.size(2);
  SA3_CHECK(T, mean.size(0) == B && mean.size(1) == H && mean.size(3) == D && (mr == 1 || mr * 128 >= S),
            "sageattn3: mean must be (B, H, 1 or ceil(S/128), D) = (", B, ", ", H, ", 1 or ", (S + 127) / 128, ", ",
            D, "), got ", shape(mean));
  int64_t rep = 1;
  if (balance.numel() > 0) {
    check_f32_on(balance, x, "balance");
    const int64_t hb = balance.numel() / (B * D);
    SA3_CHECK(T, hb >= 1 && balance.numel() == B * hb * D && H % hb == 0,
              "sageattn3: balance must be (B, Hb, 1, D) with H a multiple of Hb, got ", shape(balance), " for B ", B,
              ", H ", H, ", D ", D);
    rep = H / hb;
  }
  if (sel.numel() > 0) {
    check_cuda(sel, x, "sel");
    check_bytes(sel, "sel");
    SA3_CHECK(T, sel.numel() == B * H, "sageattn3: sel must be (B, H) bytes = ", dims(B, H), ", got ", shape(sel));
  }
  return mxfp8_fill(x.data_ptr(), dtype_of(x, "x"), B * H, S, Sp, D, floats(mean), mr,
                    balance.numel() > 0 ? floats(balance) : nullptr, balance_sign, rep,
                    sel.numel() > 0 ? bytes(sel) : nullptr, bytes(codes), bf16_out ? nullptr : bytes(scales), bf16_out,
                    rotate, row_scale);
}

template <class T>
void mxfp8_smooth_quant(T x, T mean, T balance, int64_t balance_sign, T sel, T codes, T scales, int64_t rotate,
                        double row_scale) {
  const Mxfp8Args a = mxfp8_args(x, mean, balance, balance_sign, sel, codes, scales, rotate, row_scale);
  DeviceScope scope(device_index(x));
  check_cuda_kernel<T>(smooth_quant_mxfp8(a, TensorApi<T>::stream(x)), "mxfp8_smooth_quant");
}

// mxfp8_smooth_quant_qk(q, k, mean_q, mean_k, balance, sel_q, sel_k, seq_pad, rotate) -> (q8, q8_sf,
// k8, k8_sf): both MXFP8 operands of the per-head FP8 Q.K^T in one op, which allocates them: Q's
// rows scaled by 2^-balance, K's by 2^+balance, rotated with `rotate` (0, 1, 2: mxfp8_smooth_quant's;
// with 2 Q's rows are then multiplied by 64/D: reference.fp8_rows) (mxfp8_smooth_quant's rows for
// each, in one launch: smooth_quant_mxfp8_pair; the heads whose sel byte is 0 are skipped, their
// rows stay uninitialised); codes (B, H, Sp, D)
// and scales (B, H, Sp, D/32) bytes, Sp = S rounded up to seq_pad; each its own allocation. At D 64
// the heads that leave FP4 take the 16-bit Q.K^T: codes (B, H, Sp, 2D) bytes (bf16 rows of the
// same values, reference.qk16_rows) and scales (B, H, Sp, 0).
template <class T>
std::tuple<T, T, T, T> mxfp8_smooth_quant_qk(T q, T k, T mean_q, T mean_k, T balance, T sel_q, T sel_k,
                                            int64_t seq_pad, int64_t rotate) {
  check_input(q);
  check_input(k);
  SA3_CHECK(T, q.dim() == 4 && k.dim() == 4, "sageattn3: mxfp8_smooth_quant_qk needs 4-D q and k, got ", shape(q),
            " and ", shape(k));
  SA3_CHECK(T, seq_pad > 0 && seq_pad % 16 == 0 && seq_pad <= (int64_t{1} << 20),
            "sageattn3: seq_pad must be a positive multiple of 16 (at most 2^20), got ", seq_pad);
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3), Hk = k.size(1), Sk = k.size(2);
  SA3_CHECK(T, D % 32 == 0 && k.size(0) == B && k.size(3) == D,
            "sageattn3: q and k must be (B, H, S, D) with the same B and D, a multiple of 32, got ", shape(q), " and ",
            shape(k));
  SA3_CHECK(T, q.size(1) >= 1 && k.size(1) >= 1 && dtype_of(q, "q") == dtype_of(k, "k"),
            "sageattn3: mxfp8_smooth_quant_qk needs q and k with at least one head each and the same dtype, got ",
            shape(q), " ", dtype_name(q), " and ", shape(k), " ", dtype_name(k));
  const int64_t Sqp = (Sq + seq_pad - 1) / seq_pad * seq_pad, Skp = (Sk + seq_pad - 1) / seq_pad * seq_pad;
  DeviceScope scope(device_index(q));
  const bool qk16 = D == 64;
  const int64_t row = qk16 ? 2 * D : D, sf = qk16 ? 0 : D / 32;
  const OutputSpec specs[] = {{{B, Hq, Sqp, row}, Kind::kByte}, {{B, Hq, Sqp, sf}, Kind::kByte},
                              {{B, Hk, Skp, row}, Kind::kByte}, {{B, Hk, Skp, sf}, Kind::kByte}};
  auto out = allocate_outputs(specs, q);  // torch/outputs.h
  const Mxfp8Args aq = mxfp8_args(q, mean_q, balance, -1, sel_q, out[0], out[1], rotate, rotate == 2 ? 64.0 / D : 1.0);
  const Mxfp8Args ak = mxfp8_args(k, mean_k, balance, 1, sel_k, out[2], out[3], rotate, 1.0);
  check_cuda_kernel<T>(smooth_quant_mxfp8_pair(aq, ak, TensorApi<T>::stream(q)), "mxfp8_smooth_quant_qk");
  return {out[0], out[1], out[2], out[3]};
}

}  // namespace sageattn3::torch_ops
