// Block quantization CPU kernels: INT8 and packed INT4, one fp32 scale per block.
//
// Registered with TORCH_LIBRARY as torch.ops.neox_quant.{quantize, dequantize, reduce_requantize,
// dequantize_sum, hadamard} and the *_records forms; encoded data in and out as rows (struct Rows); loaded by megatron/ops/quant/cpp.py. The format and its rounding rule are
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

// Encoded blocks seen through rows: 2-D codes and scales, each row contiguous, rows at any stride
// (k chunks back to back, or the codes and scales of k messages sharing one buffer). Block i of
// the flat sequence is block i % per_row of row i / per_row.
struct Rows {
  uint8_t* codes;
  int64_t code_stride;   // bytes between rows
  float* scales;
  int64_t scale_stride;  // floats between rows
  int64_t rows, per_row, block_bytes;

  uint8_t* codes_at(int64_t row, int64_t b) const { return codes + row * code_stride + b * block_bytes; }
  float* scale_at(int64_t row, int64_t b) const { return scales + row * scale_stride + b; }
  uint8_t* codes_of(int64_t i) const { return codes_at(i / per_row, i % per_row); }
  float* scale_of(int64_t i) const { return scale_at(i / per_row, i % per_row); }
  int64_t blocks() const { return rows * per_row; }
};

Rows rows_of(const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t block) {
  check_args(bits, block);
  TORCH_CHECK(codes.dim() == 2 && scales.dim() == 2 && codes.size(0) == scales.size(0),
              "neox_quant: codes and scales must be 2-D with the same rows");
  TORCH_CHECK((codes.stride(1) == 1 || codes.size(1) < 2) && (scales.stride(1) == 1 || scales.size(1) < 2),
              "neox_quant: each row of codes and scales must be contiguous");
  TORCH_CHECK(codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "neox_quant: wrong codes dtype");
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "neox_quant: scales must be float32");
  const int64_t block_bytes = bits == 8 ? block : block / 2;
  TORCH_CHECK(codes.size(1) == scales.size(1) * block_bytes,
              "neox_quant: codes and scales disagree in size");
  return Rows{static_cast<uint8_t*>(codes.data_ptr()), codes.stride(0), scales.data_ptr<float>(),
              scales.stride(0), codes.size(0), scales.size(1), block_bytes};
}

// k records of one contiguous byte buffer (the engine's messages), each its chunk's codes then its
// fp32 scales: the same Rows, made from the buffer and its geometry, so the caller makes no views.
// The scales must lie on 4-byte bounds (a record and its codes whole multiples of 4 bytes, the
// buffer aligned); the Python side sends the other layouts through staged copies.
Rows records_of(const at::Tensor& buf, int64_t k, int64_t bits, int64_t block) {
  check_args(bits, block);
  TORCH_CHECK(buf.dim() == 1 && buf.is_contiguous() && buf.element_size() == 1 && k >= 1 && buf.numel() % k == 0,
              "neox_quant: records must be a contiguous 1-D byte buffer of k equal records");
  const int64_t record = buf.numel() / k;
  const int64_t block_bytes = bits == 8 ? block : block / 2;
  const int64_t per_block = block_bytes + 4;
  TORCH_CHECK(record % per_block == 0, "neox_quant: a record of ", record, " bytes is not whole blocks");
  const int64_t per_row = record / per_block;
  const int64_t code_bytes = per_row * block_bytes;
  uint8_t* base = static_cast<uint8_t*>(buf.data_ptr());
  TORCH_CHECK(record % 4 == 0 && code_bytes % 4 == 0 && reinterpret_cast<uintptr_t>(base) % 4 == 0,
              "neox_quant: the records' scales do not lie on 4-byte bounds");
  return Rows{base, record, reinterpret_cast<float*>(base + code_bytes), record / 4, k, per_row, block_bytes};
}

void check_flat(const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous() && t.numel() == numel, "neox_quant: ", what,
              " must be contiguous 1-D of ", numel, " elements");
}

// Grain: enough blocks per task that a task touches at least ~64 KiB of input.
int64_t grain_blocks(int64_t block) { return std::max<int64_t>(1, 16384 / block); }

void quantize_rows(const at::Tensor& x, const Rows& out, int64_t bits, int64_t block) {
  check_flat(x, out.blocks() * block, "x");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "neox_quantize", [&] {
    const scalar_t* x_ptr = x.data_ptr<scalar_t>();
    at::parallel_for(0, out.blocks(), grain_blocks(block), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        *out.scale_of(b) = encode_block(x_ptr + b * block, block, bits, out.codes_of(b));
    });
  });
}

void dequantize_rows(const Rows& in, int64_t bits, int64_t block, const at::Tensor& out) {
  check_flat(out, in.blocks() * block, "out");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "neox_dequantize", [&] {
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, in.blocks(), grain_blocks(block), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        decode_block(in.codes_of(b), *in.scale_of(b), block, bits, out_ptr + b * block);
    });
  });
}

// Sum of block b of every row (chunk) into acc (fp32), row 0 first.
void sum_chunks(const Rows& in, int64_t b, int64_t bits, int64_t block, float* acc) {
  std::fill(acc, acc + block, 0.0f);
  for (int64_t j = 0; j < in.rows; ++j)
    accumulate_block(in.codes_at(j, b), *in.scale_at(j, b), block, bits, acc);
}

void dequantize_sum_rows(const Rows& in, int64_t bits, int64_t block, const at::Tensor& out) {
  check_flat(out, in.per_row * block, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "neox_quant: out must be float32");
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, in.per_row, grain_blocks(block), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) sum_chunks(in, b, bits, block, out_ptr + b * block);
  });
}

// Fused k-chunk reduction into the rows (codes, scales). With a residual (error feedback): quantize
// sum + residual, then store in the residual what that quantization lost, block by block while the
// sums are in cache.
void reduce_requantize_rows(const Rows& in, int64_t bits, int64_t block, const std::optional<at::Tensor>& residual,
                            const Rows& out) {
  TORCH_CHECK(out.blocks() == in.per_row, "neox_quant: the output rows hold ", out.blocks(),
              " blocks, one chunk has ", in.per_row);
  float* residual_ptr = nullptr;
  if (residual.has_value()) {
    check_flat(*residual, in.per_row * block, "residual");
    TORCH_CHECK(residual->scalar_type() == at::kFloat, "neox_quant: residual must be float32");
    residual_ptr = residual->data_ptr<float>();
  }
  at::parallel_for(0, in.per_row, grain_blocks(block), [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(block);  // one block of fp32 sums per task: stays in cache
    std::vector<float> sent(residual_ptr ? block : 0);
    for (int64_t b = b0; b < b1; ++b) {
      sum_chunks(in, b, bits, block, acc.data());
      float* r = residual_ptr ? residual_ptr + b * block : nullptr;
      if (r)
        for (int64_t i = 0; i < block; ++i) acc[i] = acc[i] + r[i];
      uint8_t* dst = out.codes_of(b);
      float* scale = out.scale_of(b);
      *scale = encode_block(acc.data(), block, bits, dst);
      if (r) {
        decode_block(dst, *scale, block, bits, sent.data());
        for (int64_t i = 0; i < block; ++i) r[i] = acc[i] - sent[i];
      }
    }
  });
}

// The ops: encoded data as (codes, scales) rows, or as k records of one byte buffer (records_of).
void quantize(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
              int64_t block) {
  quantize_rows(x, rows_of(codes, scales, bits, block), bits, block);
}

void dequantize(const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t block,
                const at::Tensor& out) {
  dequantize_rows(rows_of(codes, scales, bits, block), bits, block, out);
}

void dequantize_sum(const at::Tensor& codes_k, const at::Tensor& scales_k, int64_t bits,
                    int64_t block, const at::Tensor& out) {
  dequantize_sum_rows(rows_of(codes_k, scales_k, bits, block), bits, block, out);
}

void reduce_requantize(const at::Tensor& codes_k, const at::Tensor& scales_k, int64_t bits,
                       int64_t block, const std::optional<at::Tensor>& residual,
                       const at::Tensor& codes, const at::Tensor& scales) {
  reduce_requantize_rows(rows_of(codes_k, scales_k, bits, block), bits, block, residual,
                         rows_of(codes, scales, bits, block));
}

void quantize_records(const at::Tensor& x, const at::Tensor& buf, int64_t k, int64_t bits, int64_t block) {
  quantize_rows(x, records_of(buf, k, bits, block), bits, block);
}

void dequantize_records(const at::Tensor& buf, int64_t k, int64_t bits, int64_t block, const at::Tensor& out) {
  dequantize_rows(records_of(buf, k, bits, block), bits, block, out);
}

void dequantize_sum_records(const at::Tensor& buf, int64_t k, int64_t bits, int64_t block, const at::Tensor& out) {
  dequantize_sum_rows(records_of(buf, k, bits, block), bits, block, out);
}

void reduce_requantize_records(const at::Tensor& buf_k, int64_t k, int64_t bits, int64_t block,
                               const std::optional<at::Tensor>& residual, const at::Tensor& buf, int64_t k_out) {
  reduce_requantize_rows(records_of(buf_k, k, bits, block), bits, block, residual,
                         records_of(buf, k_out, bits, block));
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
  // Encoded data is 2-D rows (see Rows); outputs are written in place.
  m.def("quantize(Tensor x, Tensor(a!) codes, Tensor(b!) scales, int bits, int block) -> ()");
  m.def("dequantize(Tensor codes, Tensor scales, int bits, int block, Tensor(a!) out) -> ()");
  m.def("dequantize_sum(Tensor codes, Tensor scales, int bits, int block, Tensor(a!) out) -> ()");
  m.def("reduce_requantize(Tensor codes_k, Tensor scales_k, int bits, int block,"
        " Tensor(a!)? residual, Tensor(b!) codes, Tensor(c!) scales) -> ()");
  m.def("hadamard(Tensor x, int block, float scale) -> Tensor");
  // The same on k records of one byte buffer (records_of): no views made by the caller.
  m.def("quantize_records(Tensor x, Tensor(a!) buf, int k, int bits, int block) -> ()");
  m.def("dequantize_records(Tensor buf, int k, int bits, int block, Tensor(a!) out) -> ()");
  m.def("dequantize_sum_records(Tensor buf, int k, int bits, int block, Tensor(a!) out) -> ()");
  m.def("reduce_requantize_records(Tensor buf_k, int k, int bits, int block, Tensor(a!)? residual,"
        " Tensor(b!) buf, int k_out) -> ()");
}

TORCH_LIBRARY_IMPL(neox_quant, CPU, m) {
  m.impl("quantize", &quantize);
  m.impl("dequantize", &dequantize);
  m.impl("dequantize_sum", &dequantize_sum);
  m.impl("reduce_requantize", &reduce_requantize);
  m.impl("hadamard", &hadamard);
  m.impl("quantize_records", &quantize_records);
  m.impl("dequantize_records", &dequantize_records);
  m.impl("dequantize_sum_records", &dequantize_sum_records);
  m.impl("reduce_requantize_records", &reduce_requantize_records);
}
