// The outputs an op allocates itself (preprocess_qkv, qk_rule_select, mxfp8_smooth_quant_qk), carved
// from one allocation: one call of torch's caching allocator per op call instead of one per output
// (each about 5 us of host time in a profile of the preprocessing op, 13 of them).
//
// Each output is a contiguous tensor of its own dtype and shape that starts kOutputAlign bytes or
// a multiple of it into the allocation, and no two overlap. They share the allocation's storage:
// it lives while any one of them does (an output kept alone keeps the whole allocation).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "torch/checks.h"

namespace sageattn3::torch_ops {

// Where each output starts: the kernels' vector loads need 16-byte alignment; 256 bytes keep every
// output as aligned as a separate allocation of the caching allocator (512) is for the launchers'
// alignment tests (e.g. quant_cols' 16-byte stores), and an output's padding to it is slack no
// kernel writes.
constexpr int64_t kOutputAlign = 256;
constexpr int kMaxOutputDims = 4;

// The dtypes an output may have (those TensorApi<T>::empty and view_of make) and their sizes.
inline bool output_kind(Kind k) { return k == Kind::kByte || k == Kind::kFloat8e4m3fn || k == Kind::kFloat; }
inline int64_t kind_bytes(Kind k) { return k == Kind::kFloat ? 4 : 1; }

// One output: its shape (at most kMaxOutputDims dims) and dtype.
struct OutputSpec {
  int64_t sizes[kMaxOutputDims] = {};
  int64_t ndim = 0;  // the dims given (only the first kMaxOutputDims are kept: allocate_outputs refuses more)
  Kind kind = Kind::kByte;

  OutputSpec(std::initializer_list<int64_t> shape, Kind k) : kind(k) {
    for (int64_t s : shape) {
      if (ndim < kMaxOutputDims) sizes[ndim] = s;
      ++ndim;
    }
  }
  int64_t bytes() const {
    int64_t n = kind_bytes(kind);
    for (int64_t i = 0; i < ndim && i < kMaxOutputDims; ++i) n *= sizes[i];
    return n;
  }
};

template <class T, size_t N, size_t... I>
std::array<T, N> views_of(const T& buffer, const int64_t (&offsets)[N], const OutputSpec (&specs)[N],
                          std::index_sequence<I...>) {
  return {TensorApi<T>::view_of(buffer, offsets[I], specs[I].sizes, specs[I].ndim, specs[I].kind)...};
}

// The outputs `specs` describes, in their order, on like's CUDA device, carved from one new
// allocation (see the top of this file).
template <class T, size_t N>
std::array<T, N> allocate_outputs(const OutputSpec (&specs)[N], const T& like) {
  int64_t offsets[N];
  int64_t total = 0;
  for (size_t i = 0; i < N; ++i) {
    SA3_CHECK(T, specs[i].ndim <= kMaxOutputDims && output_kind(specs[i].kind),
              "sageattn3: an output must have at most ", kMaxOutputDims, " dims and be uint8, float8_e4m3fn or ",
              "float32, got ", specs[i].ndim, " dims of ", specs[i].kind);
    offsets[i] = total;
    total += (specs[i].bytes() + kOutputAlign - 1) / kOutputAlign * kOutputAlign;
  }
  const T buffer = TensorApi<T>::empty({total}, Kind::kByte, like);
  return views_of(buffer, offsets, specs, std::make_index_sequence<N>{});
}

}  // namespace sageattn3::torch_ops
