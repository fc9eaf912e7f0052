// The outputs an op allocates itself (preprocess_qkv, qk_rule_select, mxfp8_smooth_quant_qk), from
// a list of shapes and dtypes: one allocation each. Not one allocation carved into views: outputs
// that share a storage break torch's rule for custom ops (no output may alias another), which
// torch.compile checks when such an op sits in a compiled graph (torch.compile of
// sageattn3.preprocess warns, and raises under CI or TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "torch/checks.h"

namespace sageattn3::torch_ops {

constexpr int kMaxOutputDims = 4;

// The dtypes an output may have (those TensorApi<T>::empty_n makes).
inline bool output_kind(Kind k) {
  return k == Kind::kByte || k == Kind::kFloat8e4m3fn || k == Kind::kHalf || k == Kind::kFloat;
}

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
};

template <class T, size_t N, size_t... I>
std::array<T, N> make_outputs(const OutputSpec* specs, const T& like, std::index_sequence<I...>) {
  return {TensorApi<T>::empty_n(specs[I].sizes, specs[I].ndim, specs[I].kind, like)...};
}

// Refuses a spec the unit cannot allocate: more than kMaxOutputDims dims, or another dtype.
template <class T>
void check_output_spec(const OutputSpec& s) {
  SA3_CHECK(T, s.ndim <= kMaxOutputDims && output_kind(s.kind), "sageattn3: an output must have at most ",
            kMaxOutputDims, " dims and be uint8, float8_e4m3fn, float16 or float32, got ", s.ndim, " dims of ", s.kind);
}

// The outputs specs[0, N) describe, in their order, on like's CUDA device, each a new contiguous
// tensor of its own.
template <class T, size_t N>
std::array<T, N> allocate_outputs_n(const OutputSpec* specs, const T& like) {
  for (size_t i = 0; i < N; ++i) check_output_spec<T>(specs[i]);
  return make_outputs<T, N>(specs, like, std::make_index_sequence<N>{});
}

template <class T, size_t N>
std::array<T, N> allocate_outputs(const OutputSpec (&specs)[N], const T& like) {
  return allocate_outputs_n<T, N>(specs, like);
}

template <class T, size_t N>
std::array<T, N> allocate_outputs(const std::array<OutputSpec, N>& specs, const T& like) {
  return allocate_outputs_n<T, N>(specs.data(), like);
}

// An OutputSpec's bytes (uint8 and float8_e4m3fn 1 each, float16 2, float32 4), refusing what allocate_outputs
// refuses.
template <class T>
int64_t output_bytes(const OutputSpec& s) {
  check_output_spec<T>(s);
  int64_t n = s.kind == Kind::kFloat ? 4 : s.kind == Kind::kHalf ? 2 : 1;
  for (int64_t i = 0; i < s.ndim; ++i) n *= s.sizes[i];
  return n;
}

}  // namespace sageattn3::torch_ops
