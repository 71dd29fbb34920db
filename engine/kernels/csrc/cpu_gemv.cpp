// Skinny matrix products for the CPU decode step: y = x W^T for a few rows of x, with W held in
// bf16 or in INT8 with float32 scales, streamed once per call. Registered in torch.ops.tokenmill:
// gemv_pack_bf16 / gemv_pack_int8 (re-lay a weight once), gemv (y = x W^T + b), gemv_silu_mul (the
// gated MLP's product with silu(gate) * up fused into the epilogue), gemv_split, gemv_blocked,
// gemv_unpack, silu_mul, gemv_supported (whether this CPU runs a kind; "amx": whether bf16 calls of
// 1..32 rows use the tile unit), gemv_path (the path a kind takes here) and read_sum (a memory-read
// probe for bench floor).
//
// This file checks the tensors, picks each call's path from what isa.h says this process may use, and
// spreads the call's chunks over ATen's threads; the arithmetic is in kernels/ (the packed layout:
// kernels/gemv.h), one file per path:
//   AMX (bf16, 1..32 rows, K a multiple of 32): kernels/gemv_amx.cpp, the tile unit's sums (oneDNN's
//     order), the AVX-512 epilogue;
//   AVX-512 (bf16 on AVX512-BF16, INT8 on VNNI as well): kernels/gemv_avx512.cpp;
//   AVX2 + FMA (every other x86-64 CPU of the last decade): kernels/gemv_avx2.cpp, the AVX-512 path's
//     sums lane for lane.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>

#include "int16_rows.h"
#include "isa.h"
#include "kernels/gemv.h"

namespace {

using tokenmill::Isa;
using tokenmill::gemv::Geometry;
using tokenmill::gemv::Job;
using tokenmill::gemv::NB;
using tokenmill::gemv::RowMap;

// The path each kind of weight takes here (Base: none). INT8's AVX-512 path stores bf16 with the
// BF16 instructions, so it needs them too.
Isa bf16_path() {
  const tokenmill::CpuFeatures& f = tokenmill::cpu();
  return f.amx ? Isa::Amx : f.avx512_bf16 ? Isa::Avx512 : f.avx2 ? Isa::Avx2 : Isa::Base;
}
Isa int8_path() {
  const tokenmill::CpuFeatures& f = tokenmill::cpu();
  return f.avx512_bf16 && f.avx512_vnni ? Isa::Avx512 : f.avx2 ? Isa::Avx2 : Isa::Base;
}

bool supported(const std::string& kind) {
  TORCH_CHECK(kind == "bf16" || kind == "int8" || kind == "amx", "gemv_supported: kind must be 'bf16', 'int8' or 'amx'");
  if (kind == "amx") return bf16_path() == Isa::Amx;  // bf16 calls of 1..32 rows take the tile unit
  return (kind == "bf16" ? bf16_path() : int8_path()) != Isa::Base;
}

// Rows of x per work item: all of them, but where a call has fewer chunks than 8 a thread, so that the
// threads' shares even out (SmolLM2's 576x576 is 9 chunks: at 2 threads one does 5, the other 4 and
// then waits); a multiple of 4 (the register tiles' rows). The AMX path keeps whole chunks.
int64_t item_rows(int64_t m, int64_t chunks) {
  const int64_t want = 8 * static_cast<int64_t>(at::get_num_threads());
  if (chunks >= want || m <= 4) return m;
  const int64_t groups = std::min((m + 3) / 4, (want + chunks - 1) / chunks);
  return ((m + groups - 1) / groups + 3) / 4 * 4;
}

void run(const Job& j) {
  const Isa path = j.w_scale ? int8_path() : bf16_path();
  const int64_t chunks = j.g.nb / NB;
  // At least ~64 KiB of weights per task: below that starting a thread costs more than it saves.
  const int64_t chunk_bytes = NB * 16 * j.g.k2 * (j.w_scale ? 1 : 2);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / chunk_bytes);
  if (path == Isa::Amx && tokenmill::gemv::amx::applies(j)) {
    at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) { tokenmill::gemv::amx::run_chunks(j, c0, c1); });
    return;
  }
  const int64_t rows = item_rows(j.m, chunks), groups = (j.m + rows - 1) / rows;
  at::parallel_for(0, chunks * groups, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t c = i / groups, r0 = i % groups * rows, r1 = std::min(j.m, r0 + rows);
      if (path >= Isa::Avx512) {
        tokenmill::gemv::avx512::run_rows(j, c, r0, r1);
      } else {
        tokenmill::gemv::avx2::run_rows(j, c, r0, r1);
      }
    }
  });
}

// ---- packing -------------------------------------------------------------------------------------

Geometry geometry(int64_t n, int64_t k, bool interleave, int64_t groups) {
  const int64_t blocks = interleave ? 2 * ((n / 2 + 15) / 16) : (n + 15) / 16;
  const int64_t k2 = k + (k & 1);
  return {n, k, k2, (blocks + NB - 1) / NB * NB, groups, groups == 1 ? k2 / 2 : k / groups / 2};
}

template <typename T>
void pack_rows(const T* w, const Geometry& g, const RowMap& map, T* out) {
  const int64_t kp = g.k2 / 2;
  at::parallel_for(0, g.n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* dst = out + map.block(r) * kp * 32 + map.lane(r) * 2;
      for (int64_t c = 0; c < g.k; ++c) dst[(c / 2) * 32 + (c & 1)] = w[r * g.k + c];
    }
  });
}

void check_weight(const at::Tensor& w, bool interleave) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous(), "gemv_pack: weight must be contiguous [N, K]");
  TORCH_CHECK(!interleave || w.size(0) % 2 == 0, "gemv_pack: an interleaved gate/up weight needs an even N");
}

at::Tensor gemv_pack_bf16(const at::Tensor& w, bool interleave) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "gemv_pack_bf16: weight must be bfloat16");
  check_weight(w, interleave);
  const Geometry g = geometry(w.size(0), w.size(1), interleave, 1);
  auto out = at::zeros({g.nb, g.k2 / 2, 16, 2}, w.options());
  pack_rows(reinterpret_cast<const uint16_t*>(w.data_ptr()), g, RowMap{interleave ? g.n / 2 : 0},
            reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> gemv_pack_int8(const at::Tensor& q, const at::Tensor& scales, bool interleave) {
  // q: int8 [N, K]; scales: float32 [N, G]: G = 1 per channel, else groups of K / G (even) columns.
  TORCH_CHECK(q.scalar_type() == at::kChar, "gemv_pack_int8: weight must be int8");
  check_weight(q, interleave);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == q.size(0) &&
                  scales.is_contiguous() && scales.size(1) >= 1 && q.size(1) % scales.size(1) == 0 &&
                  (scales.size(1) == 1 || (q.size(1) / scales.size(1)) % 2 == 0),
              "gemv_pack_int8: scales must be contiguous float32 [N, G], G dividing K into even groups");
  const Geometry g = geometry(q.size(0), q.size(1), interleave, scales.size(1));
  auto out = at::zeros({g.nb, g.k2 / 2, 16, 2}, q.options());
  auto packed_scales = at::zeros({g.nb, g.groups, 16}, scales.options());
  const RowMap map{interleave ? g.n / 2 : 0};
  pack_rows(q.data_ptr<int8_t>(), g, map, out.data_ptr<int8_t>());
  const float* s = scales.data_ptr<float>();
  float* ps = packed_scales.data_ptr<float>();
  for (int64_t r = 0; r < g.n; ++r)
    for (int64_t gi = 0; gi < g.groups; ++gi) ps[(map.block(r) * g.groups + gi) * 16 + map.lane(r)] = s[r * g.groups + gi];
  return {out, packed_scales};
}

// The logical weight back from a packed one, dequantized (INT8) and in `dtype`: [N, K]. Walks each
// block in its stored order, writing its 16 rows two columns at a time.
template <typename T, typename O>
void unpack_rows(const T* packed, const float* scales, const Geometry& g, const RowMap& map, O* out) {
  const int64_t kp = g.k2 / 2, group = g.groups == 1 ? g.k2 : 2 * g.group_pairs;
  at::parallel_for(0, g.n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t blk = map.block(r), lane = map.lane(r);
      const T* src = packed + blk * kp * 32 + lane * 2;
      for (int64_t c = 0; c < g.k; ++c) {
        const float v = static_cast<float>(src[(c / 2) * 32 + (c & 1)]);
        out[r * g.k + c] = static_cast<O>(scales ? v * scales[(blk * g.groups + c / group) * 16 + lane] : v);
      }
    }
  });
}

// INT8 -> bf16 for even K on the INT8 path's instructions (the large-batch path dequantizes every call).
void unpack_int8_bf16(const int8_t* packed, const float* scales, const Geometry& g, const RowMap& map,
                      uint16_t* out) {
  const bool wide = int8_path() == Isa::Avx512;
  at::parallel_for(0, g.nb, 1, [&](int64_t b0, int64_t b1) {
    if (wide) {
      tokenmill::gemv::avx512::unpack_int8(packed, scales, g, map, out, b0, b1);
    } else {
      tokenmill::gemv::avx2::unpack_int8(packed, scales, g, map, out, b0, b1);
    }
  });
}

at::Tensor gemv_unpack(const at::Tensor& packed, const c10::optional<at::Tensor>& scales, int64_t n, int64_t k,
                       bool interleave, at::ScalarType dtype) {
  const bool int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == scales.has_value(), "gemv_unpack: scales go with int8 weights, and only with them");
  TORCH_CHECK(int8 || packed.scalar_type() == at::kBFloat16, "gemv_unpack: a bf16 or int8 packed weight");
  const Geometry g = geometry(n, k, interleave, int8 ? scales->size(1) : 1);
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(0) == g.nb && packed.size(1) == g.k2 / 2,
              "gemv_unpack: the packed weight does not match N, K");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "gemv_unpack: dtype must be bfloat16 or float32");
  auto out = at::empty({n, k}, packed.options().dtype(dtype));
  const RowMap map{interleave ? n / 2 : 0};
  const float* sp = int8 ? scales->data_ptr<float>() : nullptr;
  if (int8 && dtype == at::kFloat) {
    unpack_rows(packed.data_ptr<int8_t>(), sp, g, map, out.data_ptr<float>());
  } else if (int8 && k % 2 == 0 && supported("int8") && n * (k / 2) < (int64_t{1} << 31)) {
    unpack_int8_bf16(packed.data_ptr<int8_t>(), sp, g, map, reinterpret_cast<uint16_t*>(out.data_ptr()));
  } else if (int8) {
    unpack_rows(packed.data_ptr<int8_t>(), sp, g, map, out.data_ptr<c10::BFloat16>());
  } else if (dtype == at::kFloat) {
    unpack_rows(packed.data_ptr<c10::BFloat16>(), sp, g, map, out.data_ptr<float>());
  } else {
    unpack_rows(packed.data_ptr<c10::BFloat16>(), sp, g, map, out.data_ptr<c10::BFloat16>());
  }
  return out;
}

// ---- calls ---------------------------------------------------------------------------------------

// x [M, K] as 16-bit rows of k2 columns: bf16 as it is (padded when K is odd), or for INT8 int16
// quantized per row (x = q * scale, |q| <= 32767), the scales into `scale`.
at::Tensor x_rows(const at::Tensor& x2d, int64_t k2, bool int8, at::Tensor* scale) {
  if (!int8) {
    TORCH_CHECK(x2d.scalar_type() == at::kBFloat16, "gemv: bf16 weights need bf16 x");
    if (x2d.size(1) == k2 && x2d.is_contiguous()) return x2d;
    auto padded = at::zeros({x2d.size(0), k2}, x2d.options());
    padded.narrow(1, 0, x2d.size(1)).copy_(x2d);
    return padded;
  }
  *scale = at::empty({x2d.size(0)}, x2d.options().dtype(at::kFloat));
  auto q = at::zeros({x2d.size(0), k2}, x2d.options().dtype(at::kShort));
  const at::Tensor xc = x2d.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, xc.scalar_type(), "gemv_quantize_rows", [&] {
    tokenmill::quantize_int16_rows(xc.data_ptr<scalar_t>(), x2d.size(0), x2d.size(1), k2, q.data_ptr<int16_t>(), scale->data_ptr<float>());
  });
  return q;
}

at::Tensor call(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scales, int64_t n,
                int64_t k, const c10::optional<at::Tensor>& bias, bool silu, bool blocked = false, bool split = false) {
  const bool int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(supported(int8 ? "int8" : "bf16"), "gemv: this CPU has no path for these kernels (AVX2 and FMA at least)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == k, "gemv: x must be a CPU tensor [..., K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "gemv: x must be bf16 or float32");
  TORCH_CHECK(int8 == scales.has_value(), "gemv: scales go with int8 weights, and only with them");
  TORCH_CHECK(!(silu || split) || n % 2 == 0, "gemv_silu_mul / gemv_split: N (gate + up) must be even");
  const int64_t groups = int8 ? scales->size(1) : 1;
  const Geometry g = geometry(n, k, silu || split, groups);
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(0) == g.nb && packed.size(1) == g.k2 / 2,
              "gemv: the packed weight does not match N, K");
  TORCH_CHECK(!int8 || (scales->dim() == 3 && scales->size(0) == g.nb && scales->is_contiguous() &&
                        scales->scalar_type() == at::kFloat && (groups == 1 || k % groups == 0)),
              "gemv: the packed scales do not match the weight");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "gemv: bias must have N elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor x2d = x.reshape({-1, k});
  at::Tensor x_scale;
  const at::Tensor rows = x_rows(x2d, g.k2, int8, &x_scale);
  // the AVX2 path broadcasts bf16 x widened to float32 (one load a column, no shifts a row)
  const at::Tensor xf = !int8 && bf16_path() == Isa::Avx2 ? rows.to(at::kFloat) : at::Tensor();
  const int64_t out_cols = silu ? n / 2 : n;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_cols;
  auto out = at::empty(shape, x.options());
  if (x2d.size(0) == 0) return out;
  const Job j{reinterpret_cast<const uint16_t*>(rows.data_ptr()), x2d.size(0),
              int8 ? x_scale.data_ptr<float>() : nullptr, packed.data_ptr(),
              int8 ? scales->data_ptr<float>() : nullptr, bias.has_value() ? bias_f.data_ptr<float>() : nullptr,
              g, silu, out.data_ptr(), x.scalar_type() == at::kBFloat16, out_cols, blocked, split,
              xf.defined() ? xf.data_ptr<float>() : nullptr};
  run(j);
  return out;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scales, int64_t n,
                int64_t k, const c10::optional<at::Tensor>& bias) {
  return call(x, packed, scales, n, k, bias, false);
}

at::Tensor gemv_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scales,
                         int64_t n, int64_t k, const c10::optional<at::Tensor>& bias) {
  return call(x, packed, scales, n, k, bias, true);
}

// y = x W^T + b = [gate | up] for a weight packed interleaved (a gated MLP's gate/up, for silu_mul): the
// product itself, for a caller that adds to it before the activation (LoRA deltas).
at::Tensor gemv_split(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scales,
                      int64_t n, int64_t k, const c10::optional<at::Tensor>& bias) {
  return call(x, packed, scales, n, k, bias, false, false, true);
}

// y = x W^T + b for a bf16 weight, summed in oneDNN's AMX order (tile_bf16_blocked): the batch-invariant
// mode's small-batch product, bit-identical to oneDNN's where the start-up check finds it so.
at::Tensor gemv_blocked(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16,
              "gemv_blocked: bf16 x and a bf16 packed weight");
  return call(x, packed, c10::nullopt, n, k, bias, false, true);
}

bool gemv_supported(c10::string_view kind) { return supported(std::string(kind)); }

// The path a kind takes on this CPU: "AMX" (bf16 calls of 1..32 rows; AVX-512 for the rest),
// "AVX-512", "AVX2", or "none".
std::string gemv_path(c10::string_view kind) {
  TORCH_CHECK(kind == "bf16" || kind == "int8", "gemv_path: kind must be 'bf16' or 'int8'");
  const Isa path = kind == "bf16" ? bf16_path() : int8_path();
  return path == Isa::Base ? "none" : tokenmill::isa_name(path);
}

// silu(gate) * up of a bf16 [T, 2I] = [gate | up] product, with the fused product's arithmetic and
// roundings (silu_mul above): a LoRA step's gate/up takes the adapters' delta between the product and
// the activation, so the fused product cannot run there; this keeps its activation what the fused
// product gives the same rows (and costs one pass, where PyTorch's silu and mul take two and an
// intermediate). AVX-512 BF16 or AVX2 (the same bits); on neither, PyTorch's silu and mul.
at::Tensor silu_mul_rows(const at::Tensor& gu) {
  TORCH_CHECK(gu.device().is_cpu() && gu.scalar_type() == at::kBFloat16 && gu.dim() == 2 && gu.size(1) % 2 == 0 &&
                  gu.stride(1) == 1,
              "silu_mul: gu must be a bf16 CPU matrix [T, 2I] with contiguous rows");
  const int64_t rows = gu.size(0), half = gu.size(1) / 2;
  const Isa path = bf16_path();
  if (path == Isa::Base) {
    auto parts = gu.chunk(2, -1);
    return at::silu(parts[0]) * parts[1];
  }
  at::Tensor out = at::empty({rows, half}, gu.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(gu.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t ld = gu.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, half)), [&](int64_t r0, int64_t r1) {
    if (path >= Isa::Avx512) {
      tokenmill::gemv::avx512::silu_rows(src, ld, dst, half, r0, r1);
    } else {
      tokenmill::gemv::avx2::silu_rows(src, ld, dst, half, r0, r1);
    }
  });
  return out;
}

// Words [b, e) summed on the widest path here (the portable loop: eight lanes the compiler vectorises).
uint64_t sum_words(const uint64_t* p, int64_t b, int64_t e) {
  const Isa isa = tokenmill::vector_isa();
  if (isa == Isa::Avx512) return tokenmill::gemv::avx512::sum_words(p, b, e);
  if (isa == Isa::Avx2) return tokenmill::gemv::avx2::sum_words(p, b, e);
  uint64_t lane[8] = {};
  int64_t i = b;
  for (; i + 8 <= e; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += p[i + l];
  uint64_t s = 0;
  for (; i < e; ++i) s += p[i];
  for (int l = 0; l < 8; ++l) s += lane[l];
  return s;
}

int64_t read_sum(const at::Tensor& buf) {
  // Reads every byte of a buffer over the intra-op threads (a memory-read probe for bench floor).
  TORCH_CHECK(buf.is_contiguous() && buf.nbytes() % 8 == 0, "read_sum: contiguous, whole 64-bit words");
  const uint64_t* p = static_cast<const uint64_t*>(buf.data_ptr());
  const int64_t words = static_cast<int64_t>(buf.nbytes() / 8);
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, words, 1 << 16, [&](int64_t b, int64_t e) { total += sum_words(p, b, e); });
  return static_cast<int64_t>(total.load());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("gemv_supported(str kind) -> bool");
  m.def("gemv_path(str kind) -> str");
  m.def("gemv_pack_bf16(Tensor w, bool interleave) -> Tensor");
  m.def("gemv_pack_int8(Tensor q, Tensor scales, bool interleave) -> (Tensor, Tensor)");
  m.def("gemv(Tensor x, Tensor packed, Tensor? scales, int n, int k, Tensor? bias) -> Tensor");
  m.def("gemv_silu_mul(Tensor x, Tensor packed, Tensor? scales, int n, int k, Tensor? bias) -> Tensor");
  m.def("gemv_blocked(Tensor x, Tensor packed, int n, int k, Tensor? bias) -> Tensor");
  m.def("gemv_split(Tensor x, Tensor packed, Tensor? scales, int n, int k, Tensor? bias) -> Tensor");
  m.def("gemv_unpack(Tensor packed, Tensor? scales, int n, int k, bool interleave, ScalarType dtype) -> Tensor");
  m.def("read_sum(Tensor buf) -> int");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul_rows));
  m.impl("gemv_supported", c10::DispatchKey::CatchAll, TORCH_FN(gemv_supported));
  m.impl("gemv_path", c10::DispatchKey::CatchAll, TORCH_FN(gemv_path));
  m.impl("gemv_pack_bf16", c10::DispatchKey::CPU, TORCH_FN(gemv_pack_bf16));
  m.impl("gemv_pack_int8", c10::DispatchKey::CPU, TORCH_FN(gemv_pack_int8));
  m.impl("gemv", c10::DispatchKey::CPU, TORCH_FN(gemv));
  m.impl("gemv_silu_mul", c10::DispatchKey::CPU, TORCH_FN(gemv_silu_mul));
  m.impl("gemv_blocked", c10::DispatchKey::CPU, TORCH_FN(gemv_blocked));
  m.impl("gemv_split", c10::DispatchKey::CPU, TORCH_FN(gemv_split));
  m.impl("gemv_unpack", c10::DispatchKey::CPU, TORCH_FN(gemv_unpack));
  m.impl("read_sum", c10::DispatchKey::CPU, TORCH_FN(read_sum));
}
