// Block quantization CPU kernels: INT8 and packed INT4, one fp32 scale per block.
//
// Registered with TORCH_LIBRARY as torch.ops.neox_quant.{quantize, dequantize, reduce_requantize,
// dequantize_sum, hadamard}; loaded by megatron/ops/quant/cpp.py. The format and its rounding rule are
// documented in megatron/ops/quant/base.py; every result here must equal the torch reference
// (megatron/ops/quant/reference.py) bit for bit, which is why the build must not use -ffast-math
// (it would allow reciprocal division and reassociation) and uses -ffp-contract=off (a fused
// multiply-add in the k-chunk sum would round differently from the reference's mul then add).
//
// Each block is independent: blocks are spread over threads with at::parallel_for (OpenMP), and
// the loops inside a block are plain, branch-free and vectorizable.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

// Adding then subtracting 1.5 * 2^23 rounds a float to an integer, half to even, under the default
// rounding mode: the sum lands in [2^23, 2^24) where one ulp is 1. Exact for |v| < 2^22; our
// values stay below 2 * qmax. Unlike std::nearbyint it vectorizes on baseline x86-64 (no SSE4.1),
// and with -march=native it is as fast.
constexpr float kRoundMagic = 12582912.0f;

inline float round_half_even(float v) { return (v + kRoundMagic) - kRoundMagic; }

// |v| as raw bits: for non-negative floats the integer order is the float order, and NaN / inf are
// exactly the values >= 0x7f800000, so an integer max gives the block amax with NaN preserved
// (a float max would drop NaN). The bits fit in int32, and a signed max vectorizes even on SSE2.
inline uint32_t abs_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b & 0x7fffffffu;
}

inline float from_bits(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

inline bool is_finite_scale(float s) { return abs_bits(s) < 0x7f800000u; }

// Sign-extend a 4-bit two's complement nibble.
inline int nibble_value(int nib) { return nib - ((nib & 0x8) << 1); }

float qmax_for(int64_t bits) { return bits == 8 ? 127.0f : 7.0f; }

// Scale of one block: amax / qmax by IEEE division, 0 -> 1; NaN/inf stay NaN/inf (refused later).
template <typename T>
float block_scale(const T* x, int64_t n, float qmax) {
  int32_t m = 0;
  for (int64_t i = 0; i < n; ++i)
    m = std::max(m, static_cast<int32_t>(abs_bits(static_cast<float>(x[i]))));
  const float scale = from_bits(static_cast<uint32_t>(m)) / qmax;
  return scale == 0.0f ? 1.0f : scale;
}

inline int encode_one(float v, float scale, float qmax) {
  const float r = round_half_even(v / scale);
  return static_cast<int>(std::min(std::max(r, -qmax), qmax));
}

// Encode one block of n values from x into codes (n int8, or n / 2 packed bytes); returns scale.
template <typename T>
float encode_block(const T* x, int64_t n, int64_t bits, void* codes) {
  const float qmax = qmax_for(bits);
  const float scale = block_scale(x, n, qmax);
  const int64_t code_bytes = bits == 8 ? n : n / 2;
  if (!is_finite_scale(scale)) {  // the caller raises; write defined bytes meanwhile
    std::memset(codes, 0, code_bytes);
    return scale;
  }
  if (bits == 8) {
    int8_t* out = static_cast<int8_t*>(codes);
    for (int64_t i = 0; i < n; ++i)
      out[i] = static_cast<int8_t>(encode_one(static_cast<float>(x[i]), scale, qmax));
  } else {
    uint8_t* out = static_cast<uint8_t*>(codes);
    for (int64_t i = 0; i < n / 2; ++i) {
      const int lo = encode_one(static_cast<float>(x[2 * i]), scale, qmax);
      const int hi = encode_one(static_cast<float>(x[2 * i + 1]), scale, qmax);
      out[i] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
    }
  }
  return scale;
}

// acc[i] = acc[i] + code[i] * scale over one block (separate mul and add, as the reference does).
inline void accumulate_block(const void* codes, float scale, int64_t n, int64_t bits, float* acc) {
  if (bits == 8) {
    const int8_t* c = static_cast<const int8_t*>(codes);
    for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + static_cast<float>(c[i]) * scale;
  } else {
    const uint8_t* c = static_cast<const uint8_t*>(codes);
    for (int64_t i = 0; i < n / 2; ++i) {
      acc[2 * i] = acc[2 * i] + static_cast<float>(nibble_value(c[i] & 0xF)) * scale;
      acc[2 * i + 1] = acc[2 * i + 1] + static_cast<float>(nibble_value(c[i] >> 4)) * scale;
    }
  }
}

// out[i] = code[i] * scale over one block, rounded once into T.
template <typename T>
void decode_block(const void* codes, float scale, int64_t n, int64_t bits, T* out) {
  if (bits == 8) {
    const int8_t* c = static_cast<const int8_t*>(codes);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(static_cast<float>(c[i]) * scale);
  } else {
    const uint8_t* c = static_cast<const uint8_t*>(codes);
    for (int64_t i = 0; i < n / 2; ++i) {
      out[2 * i] = static_cast<T>(static_cast<float>(nibble_value(c[i] & 0xF)) * scale);
      out[2 * i + 1] = static_cast<T>(static_cast<float>(nibble_value(c[i] >> 4)) * scale);
    }
  }
}

void check_args(int64_t bits, int64_t block) {
  TORCH_CHECK(bits == 8 || bits == 4, "neox_quant: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(block >= 1 && (bits == 8 || block % 2 == 0), "neox_quant: bad block ", block);
}

void check_codes(const at::Tensor& codes, const at::Tensor& scales, int64_t k, int64_t bits,
                 int64_t block) {
  check_args(bits, block);
  TORCH_CHECK(codes.dim() == 1 && codes.is_contiguous() && scales.dim() == 1 &&
                  scales.is_contiguous(), "neox_quant: codes and scales must be contiguous 1-D");
  TORCH_CHECK(codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "neox_quant: wrong codes dtype");
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "neox_quant: scales must be float32");
  TORCH_CHECK(k >= 1 && scales.numel() % k == 0, "neox_quant: bad k ", k);
  const int64_t values = codes.numel() * (bits == 8 ? 1 : 2);
  TORCH_CHECK(values == scales.numel() * block, "neox_quant: codes and scales disagree in size");
}

// Grain: enough blocks per task that a task touches at least ~64 KiB of input.
int64_t grain_blocks(int64_t block) { return std::max<int64_t>(1, 16384 / block); }

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x, int64_t bits, int64_t block) {
  check_args(bits, block);
  TORCH_CHECK(x.dim() == 1 && x.is_contiguous(), "neox_quant: x must be contiguous 1-D");
  TORCH_CHECK(x.numel() % block == 0, "neox_quant: numel not a multiple of block");
  const int64_t n_blocks = x.numel() / block;
  const int64_t block_bytes = bits == 8 ? block : block / 2;
  at::Tensor codes = at::empty({n_blocks * block_bytes},
                               x.options().dtype(bits == 8 ? at::kChar : at::kByte));
  at::Tensor scales = at::empty({n_blocks}, x.options().dtype(at::kFloat));
  uint8_t* codes_ptr = static_cast<uint8_t*>(codes.data_ptr());
  float* scales_ptr = scales.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "neox_quantize", [&] {
    const scalar_t* x_ptr = x.data_ptr<scalar_t>();
    at::parallel_for(0, n_blocks, grain_blocks(block), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        scales_ptr[b] = encode_block(x_ptr + b * block, block, bits, codes_ptr + b * block_bytes);
    });
  });
  return {codes, scales};
}

at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                      int64_t block, at::ScalarType dtype) {
  check_codes(codes, scales, 1, bits, block);
  const int64_t n_blocks = scales.numel();
  const int64_t block_bytes = bits == 8 ? block : block / 2;
  at::Tensor out = at::empty({n_blocks * block}, scales.options().dtype(dtype));
  const uint8_t* codes_ptr = static_cast<const uint8_t*>(codes.data_ptr());
  const float* scales_ptr = scales.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "neox_dequantize", [&] {
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, n_blocks, grain_blocks(block), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        decode_block(codes_ptr + b * block_bytes, scales_ptr[b], block, bits, out_ptr + b * block);
    });
  });
  return out;
}

// Sum of the k chunks of one block position into acc (fp32), chunk 0 first.
void sum_chunks(const uint8_t* codes_ptr, const float* scales_ptr, int64_t k, int64_t n_blocks,
                int64_t b, int64_t bits, int64_t block, float* acc) {
  const int64_t block_bytes = bits == 8 ? block : block / 2;
  std::fill(acc, acc + block, 0.0f);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t chunk_block = j * n_blocks + b;
    accumulate_block(codes_ptr + chunk_block * block_bytes, scales_ptr[chunk_block], block, bits,
                     acc);
  }
}

at::Tensor dequantize_sum(const at::Tensor& codes_k, const at::Tensor& scales_k, int64_t k,
                          int64_t bits, int64_t block) {
  check_codes(codes_k, scales_k, k, bits, block);
  const int64_t n_blocks = scales_k.numel() / k;
  at::Tensor out = at::empty({n_blocks * block}, scales_k.options());
  const uint8_t* codes_ptr = static_cast<const uint8_t*>(codes_k.data_ptr());
  const float* scales_ptr = scales_k.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, n_blocks, grain_blocks(block), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      sum_chunks(codes_ptr, scales_ptr, k, n_blocks, b, bits, block, out_ptr + b * block);
  });
  return out;
}

// Fused k-chunk reduction. With a residual (error feedback): quantize sum + residual, then store
// in the residual what that quantization lost, block by block while the sums are in cache.
std::tuple<at::Tensor, at::Tensor> reduce_requantize(const at::Tensor& codes_k,
                                                     const at::Tensor& scales_k, int64_t k,
                                                     int64_t bits, int64_t block,
                                                     const std::optional<at::Tensor>& residual) {
  check_codes(codes_k, scales_k, k, bits, block);
  const int64_t n_blocks = scales_k.numel() / k;
  const int64_t block_bytes = bits == 8 ? block : block / 2;
  float* residual_ptr = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->dim() == 1 && residual->is_contiguous() &&
                    residual->scalar_type() == at::kFloat && residual->numel() == n_blocks * block,
                "neox_quant: residual must be contiguous fp32 of one chunk");
    residual_ptr = residual->data_ptr<float>();
  }
  at::Tensor codes = at::empty({n_blocks * block_bytes}, codes_k.options());
  at::Tensor scales = at::empty({n_blocks}, scales_k.options());
  const uint8_t* in_codes = static_cast<const uint8_t*>(codes_k.data_ptr());
  const float* in_scales = scales_k.data_ptr<float>();
  uint8_t* out_codes = static_cast<uint8_t*>(codes.data_ptr());
  float* out_scales = scales.data_ptr<float>();
  at::parallel_for(0, n_blocks, grain_blocks(block), [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(block);  // one block of fp32 sums per task: stays in cache
    std::vector<float> sent(residual_ptr ? block : 0);
    for (int64_t b = b0; b < b1; ++b) {
      sum_chunks(in_codes, in_scales, k, n_blocks, b, bits, block, acc.data());
      float* r = residual_ptr ? residual_ptr + b * block : nullptr;
      if (r)
        for (int64_t i = 0; i < block; ++i) acc[i] = acc[i] + r[i];
      uint8_t* dst = out_codes + b * block_bytes;
      out_scales[b] = encode_block(acc.data(), block, bits, dst);
      if (r) {
        decode_block(dst, out_scales[b], block, bits, sent.data());
        for (int64_t i = 0; i < block; ++i) r[i] = acc[i] - sent[i];
      }
    }
  });
  return {codes, scales};
}

// The blockwise orthonormal Walsh-Hadamard transform (base.py, "Rotation"): butterfly stages in
// increasing stride, (u, v) -> (u + v, u - v) in fp32, then one multiply by `scale`. Adds and
// subtracts round the same however the compiler vectorizes them, so the bits equal the reference's.
at::Tensor hadamard(const at::Tensor& x, int64_t block, double scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 1,
              "hadamard: x must be a contiguous 1-D float32 tensor");
  const int64_t n_blocks = x.numel() / block;
  at::Tensor out = x.clone();
  float* data = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, n_blocks, grain_blocks(block), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* v = data + b * block;
      for (int64_t half = 1; half < block; half *= 2) {
        for (int64_t start = 0; start < block; start += 2 * half) {
          for (int64_t i = start; i < start + half; ++i) {
            const float u = v[i], w = v[i + half];
            v[i] = u + w;
            v[i + half] = u - w;
          }
        }
      }
      for (int64_t i = 0; i < block; ++i) v[i] = v[i] * s;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(neox_quant, m) {
  m.def("quantize(Tensor x, int bits, int block) -> (Tensor, Tensor)");
  m.def("dequantize(Tensor codes, Tensor scales, int bits, int block, ScalarType dtype) -> Tensor");
  m.def("dequantize_sum(Tensor codes, Tensor scales, int k, int bits, int block) -> Tensor");
  m.def("reduce_requantize(Tensor codes, Tensor scales, int k, int bits, int block,"
        " Tensor(a!)? residual=None) -> (Tensor, Tensor)");
  m.def("hadamard(Tensor x, int block, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(neox_quant, CPU, m) {
  m.impl("quantize", &quantize);
  m.impl("dequantize", &dequantize);
  m.impl("dequantize_sum", &dequantize_sum);
  m.impl("reduce_requantize", &reduce_requantize);
  m.impl("hadamard", &hadamard);
}
