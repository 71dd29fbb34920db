// A mixture-of-experts layer's routed experts in one call on the CPU (engine/models/cpu_moe.py): the
// tokens of a step grouped by expert, each active expert's weights streamed once for all its tokens,
// and the work of every active expert spread over ATen's threads by (expert, chunk of 64 output rows),
// so that at batch 1 the top-k experts' rows keep every core busy (a per-expert call from Python
// leaves each product to split its few chunks alone, and pays the interpreter and the dispatcher
// twice per expert: 2 K calls a layer).
//
// Registered in torch.ops.tokenmill: moe_experts(x, ids, weights, gate_up, gate_up_scales, down,
// down_scales, inter) and moe_path(). Shapes: x [T, H]; ids [T, K] int64 and weights [T, K] float32
// (the routing, in Python); per expert e, gate_up[e] and down[e] are the per-expert linear modules'
// own packed weights (no copy):
//   bf16 (GemvLinear, interleaved gate/up): kernels/gemv.h's layout, silu(gate) * up in the product's
//     epilogue (gemv_silu_mul's arithmetic), x bf16;
//   int8 (Int8Linear, interleaved): the same layout in int8 with packed float32 scales, x bf16 or float32
//     (each row quantized to int16 as cpu_gemv.cpp's x_rows does);
//   float32 (GemvF32Linear, plain [gate; up] rows): kernels/gemv_f32.h's layout, then PyTorch's silu and
//     mul (the Python MLP's, engine/models/layers.py silu_mul), x float32.
// Out: [T, H] in x's dtype = sum over each token's experts, in ascending expert id, of
// round(weight) * down(act(gate) * up), with grouped_experts' roundings (engine/models/moe.py: the rows
// scaled in x's dtype, then summed into a zero row in order by index_add_, in float32): the same bits as the Python
// loop over the same modules (tests/engine/test_cpu_moe.py).
//
// The arithmetic is the linear group's (kernels/gemv_*.cpp, kernels/gemv_f32_avx2.cpp, built into this
// group's library too); this file only sorts, gathers, picks each product's path (isa.h) and adds up.
// On a CPU without AVX2 and FMA there is no path (moe_path "none"): the Python loop runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "int16_rows.h"
#include "isa.h"
#include "kernels/bf16.h"
#include "kernels/gemv.h"
#include "kernels/gemv_f32.h"

namespace {

using tokenmill::Isa;
using tokenmill::gemv::Geometry;
using tokenmill::gemv::Job;
using tokenmill::gemv::NB;

enum class Kind { Bf16, Int8, F32 };

// cpu_gemv.cpp's choice of path per kind of weight (Base: none).
Isa bf16_path() {
  const tokenmill::CpuFeatures& f = tokenmill::cpu();
  return f.amx ? Isa::Amx : f.avx512_bf16 ? Isa::Avx512 : f.avx2 ? Isa::Avx2 : Isa::Base;
}
Isa int8_path() {
  const tokenmill::CpuFeatures& f = tokenmill::cpu();
  return f.avx512_bf16 && f.avx512_vnni ? Isa::Avx512 : f.avx2 ? Isa::Avx2 : Isa::Base;
}
Isa path_of(Kind kind) {
  if (kind == Kind::F32) return tokenmill::cpu().avx2 ? Isa::Avx2 : Isa::Base;
  return kind == Kind::Int8 ? int8_path() : bf16_path();
}

// cpu_gemv.cpp's geometry of a packed weight [N, K] (interleave: gate/up block pairs).
Geometry geometry(int64_t n, int64_t k, bool interleave, int64_t groups) {
  const int64_t blocks = interleave ? 2 * ((n / 2 + 15) / 16) : (n + 15) / 16;
  const int64_t k2 = k + (k & 1);
  return {n, k, k2, (blocks + NB - 1) / NB * NB, groups, groups == 1 ? k2 / 2 : k / groups / 2};
}

// The operand rows of one product for the 16-bit kernels, [P, k2] (zero padded when K is odd): bf16
// as given, or INT8's int16 rows q = round(x / scale), scale = max |x| / 32767 (int16_rows.h's
// quantize_int16_rows); and the AVX2 bf16 path's float32 copy (its broadcasts).
struct Operand {
  at::Tensor rows;   // [P, k2] bf16 or int16
  at::Tensor scale;  // [P] float32 (INT8)
  at::Tensor xf;     // [P, k2] float32 (the AVX2 bf16 path)
};

Operand operand(const at::Tensor& x2d, Kind kind, int64_t k2) {
  Operand o;
  if (kind == Kind::Int8) {
    o.scale = at::empty({x2d.size(0)}, x2d.options().dtype(at::kFloat));
    o.rows = at::zeros({x2d.size(0), k2}, x2d.options().dtype(at::kShort));
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x2d.scalar_type(), "moe_quantize_rows", [&] {
      tokenmill::quantize_int16_rows(x2d.data_ptr<scalar_t>(), x2d.size(0), x2d.size(1), k2, o.rows.data_ptr<int16_t>(),
                    o.scale.data_ptr<float>());
    });
    return o;
  }
  o.rows = x2d;
  if (x2d.size(1) != k2) {
    o.rows = at::zeros({x2d.size(0), k2}, x2d.options());
    o.rows.narrow(1, 0, x2d.size(1)).copy_(x2d);
  }
  if (bf16_path() == Isa::Avx2) o.xf = o.rows.to(at::kFloat);
  return o;
}

// One product per active expert: rows [start, start + n) of the sorted pairs against expert e's weight.
struct Product {
  int64_t e, start, n;
};

// Every active expert's product in one parallel loop over (expert, chunk): each item streams one chunk
// of one expert's weight for all that expert's rows (the AMX path: its chunk for 1..32 rows). make(p)
// gives product p's Job.
template <typename MakeJob>
void run_products(const std::vector<Product>& products, int64_t chunks, Isa path, MakeJob make) {
  std::vector<Job> jobs;
  jobs.reserve(products.size());
  for (const Product& p : products) jobs.push_back(make(p));
  const int64_t items = static_cast<int64_t>(jobs.size()) * chunks;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Job& j = jobs[i / chunks];
      const int64_t c = i % chunks;
      if (path == Isa::Amx && tokenmill::gemv::amx::applies(j)) {
        tokenmill::gemv::amx::run_chunks(j, c, c + 1);
      } else if (path >= Isa::Avx512) {
        tokenmill::gemv::avx512::run_rows(j, c, 0, j.m);
      } else {
        tokenmill::gemv::avx2::run_rows(j, c, 0, j.m);
      }
    }
  });
}

// The float32 kernel's products: out rows [start, start + n) = x rows times expert e's weight [n_out, k].
void run_f32(const std::vector<Product>& products, const at::TensorList& w, const float* x, int64_t k, int64_t n_out,
             float* out) {
  const int64_t groups = tokenmill::gemv_f32::blocks(n_out) / tokenmill::gemv_f32::GB;
  const int64_t items = static_cast<int64_t>(products.size()) * groups;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Product& p = products[i / groups];
      const int64_t g = i % groups;
      tokenmill::gemv_f32::avx2::run_groups(x + p.start * k, p.n, k, w[p.e].data_ptr<float>(), n_out, nullptr,
                                            out + p.start * n_out, g, g + 1);
    }
  });
}

Kind kind_of(const at::TensorList& w, const at::TensorList& scales, const char* what) {
  TORCH_CHECK(!w.empty(), "moe_experts: ", what, " needs one packed weight per expert");
  const at::ScalarType t = w[0].scalar_type();
  const Kind kind = t == at::kBFloat16 ? Kind::Bf16 : t == at::kChar ? Kind::Int8 : Kind::F32;
  TORCH_CHECK(t == at::kBFloat16 || t == at::kChar || t == at::kFloat, "moe_experts: ", what,
              " weights must be packed bf16, int8 or float32");
  TORCH_CHECK(kind == Kind::Int8 ? scales.size() == w.size() : scales.empty(), "moe_experts: ", what,
              " scales go with int8 weights (one per expert), and only with them");
  for (const at::Tensor& t2 : w)
    TORCH_CHECK(t2.scalar_type() == t && t2.is_contiguous() && t2.device().is_cpu() && t2.sizes() == w[0].sizes(),
                "moe_experts: every expert's ", what, " weight must be packed alike (contiguous, one shape and dtype)");
  for (const at::Tensor& s : scales)
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 3 && s.sizes() == scales[0].sizes(),
                "moe_experts: ", what, " scales must be packed float32 [Nb, G, 16], alike for every expert");
  return kind;
}

// Checks a 16-bit kernel's packed weight against its geometry.
void check_packed(const at::Tensor& w, const at::TensorList& scales, const Geometry& g, const char* what) {
  TORCH_CHECK(w.dim() == 4 && w.size(0) == g.nb && w.size(1) == g.k2 / 2 && w.size(2) == 16 && w.size(3) == 2,
              "moe_experts: the ", what, " weight does not match its shape");
  TORCH_CHECK(scales.empty() || scales[0].size(0) == g.nb, "moe_experts: the ", what, " scales do not match");
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, at::TensorList gate_up,
                       at::TensorList gate_up_scales, at::TensorList down, at::TensorList down_scales, int64_t inter) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "moe_experts: x must be a CPU matrix [T, H]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "moe_experts: x must be bf16 or float32");
  const int64_t t = x.size(0), h = x.size(1);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == t && ids.size(1) >= 1,
              "moe_experts: ids must be int64 [T, K]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == ids.sizes(), "moe_experts: weights must be float32 [T, K]");
  const Kind kind = kind_of(gate_up, gate_up_scales, "gate_up");
  TORCH_CHECK(kind_of(down, down_scales, "down") == kind && gate_up.size() == down.size(),
              "moe_experts: gate_up and down must be one kind, one per expert");
  TORCH_CHECK(inter >= 1, "moe_experts: inter must be positive");
  const Isa path = path_of(kind);
  TORCH_CHECK(path != Isa::Base, "moe_experts: this CPU has no path for these kernels (AVX2 and FMA at least)");
  TORCH_CHECK(kind != Kind::Bf16 || x.scalar_type() == at::kBFloat16, "moe_experts: bf16 weights need bf16 x");
  TORCH_CHECK(kind != Kind::F32 || x.scalar_type() == at::kFloat, "moe_experts: float32 weights need float32 x");
  const int64_t num_experts = static_cast<int64_t>(gate_up.size()), k = ids.size(1), pairs = t * k;

  // ---- group the (token, expert) pairs by expert: a stable counting sort (moe.py's stable argsort) --
  const at::Tensor idc = ids.contiguous(), wc = weights.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  std::vector<int64_t> count(num_experts + 1, 0), order(pairs), token_of(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "moe_experts: expert id ", id[p], " out of range [0, ", num_experts, ")");
    ++count[id[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) count[e + 1] += count[e];  // count[e]: first sorted pair of e
  {
    std::vector<int64_t> fill(count.begin(), count.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) order[fill[id[p]]++] = p;
  }
  std::vector<Product> products;
  for (int64_t e = 0; e < num_experts; ++e)
    if (count[e + 1] > count[e]) products.push_back({e, count[e], count[e + 1] - count[e]});
  for (int64_t i = 0; i < pairs; ++i) token_of[i] = order[i] / k;

  // ---- the sorted pairs' rows of x, [P, H] -------------------------------------------------------
  const at::Tensor xc = x.contiguous();
  at::Tensor rows = at::empty({pairs, h}, x.options());
  {
    const int64_t row_bytes = h * x.element_size();
    const char* src = static_cast<const char*>(xc.data_ptr());
    char* dst = static_cast<char*>(rows.data_ptr());
    for (int64_t i = 0; i < pairs; ++i) std::memcpy(dst + i * row_bytes, src + token_of[i] * row_bytes, row_bytes);
  }

  // ---- act(gate) * up for every pair, [P, I]; then down, [P, H] -----------------------------------
  at::Tensor y = at::empty({pairs, h}, x.options());
  if (kind == Kind::F32) {
    TORCH_CHECK(gate_up[0].dim() == 3 && gate_up[0].size(0) == tokenmill::gemv_f32::blocks(2 * inter) &&
                    gate_up[0].size(1) == h && down[0].dim() == 3 && down[0].size(0) == tokenmill::gemv_f32::blocks(h) &&
                    down[0].size(1) == inter,
                "moe_experts: the float32 packed weights do not match H and inter");
    at::Tensor gu = at::empty({pairs, 2 * inter}, x.options());
    run_f32(products, gate_up, rows.data_ptr<float>(), h, 2 * inter, gu.data_ptr<float>());
    // per expert, as the Python MLP applies it to each expert's product (elementwise: the same bits)
    const at::Tensor act = (at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter)).contiguous();  // [P, I]
    run_f32(products, down, act.data_ptr<float>(), inter, h, y.data_ptr<float>());
  } else {
    const int64_t groups_gu = gate_up_scales.empty() ? 1 : gate_up_scales[0].size(1);
    const int64_t groups_dn = down_scales.empty() ? 1 : down_scales[0].size(1);
    const Geometry g_gu = geometry(2 * inter, h, true, groups_gu), g_dn = geometry(h, inter, false, groups_dn);
    check_packed(gate_up[0], gate_up_scales, g_gu, "gate_up");
    check_packed(down[0], down_scales, g_dn, "down");
    TORCH_CHECK(groups_gu == 1 || h % groups_gu == 0, "moe_experts: gate_up scale groups must divide H");
    TORCH_CHECK(groups_dn == 1 || inter % groups_dn == 0, "moe_experts: down scale groups must divide inter");
    const bool out_bf16 = x.scalar_type() == at::kBFloat16;
    auto job = [&](const Operand& in, int64_t k2, const Product& p, const at::Tensor& w, const at::TensorList& scales,
                   const Geometry& g, bool silu, void* out, int64_t out_cols) {
      const int64_t at_row = p.start;
      return Job{reinterpret_cast<const uint16_t*>(in.rows.data_ptr()) + at_row * k2, p.n,
                 kind == Kind::Int8 ? in.scale.data_ptr<float>() + at_row : nullptr, w.data_ptr(),
                 kind == Kind::Int8 ? scales[p.e].data_ptr<float>() : nullptr, nullptr, g, silu,
                 static_cast<char*>(out) + at_row * out_cols * (out_bf16 ? 2 : 4), out_bf16, out_cols, false, false,
                 in.xf.defined() ? in.xf.data_ptr<float>() + at_row * k2 : nullptr};
    };
    const Operand in_gu = operand(rows, kind, g_gu.k2);
    at::Tensor act = at::empty({pairs, inter}, x.options());  // silu(gate) * up from the epilogue
    run_products(products, g_gu.nb / NB, path, [&](const Product& p) {
      return job(in_gu, g_gu.k2, p, gate_up[p.e], gate_up_scales, g_gu, true, act.data_ptr(), inter);
    });
    const Operand in_dn = operand(act, kind, g_dn.k2);
    run_products(products, g_dn.nb / NB, path, [&](const Product& p) {
      return job(in_dn, g_dn.k2, p, down[p.e], down_scales, g_dn, false, y.data_ptr(), h);
    });
  }

  // ---- back to the tokens: out[t] = ((0 + y_a w_a) + y_b w_b) + ..., in sorted (ascending expert)
  // order: each product rounded to x's dtype (grouped_experts' mul), the sum in float32 and rounded
  // once (ATen's index_add_ into a bf16 tensor accumulates in float32) --------------------------------
  std::vector<int64_t> first(t + 1, 0), by_token(pairs);  // the sorted pairs of each token, in order
  for (int64_t i = 0; i < pairs; ++i) ++first[token_of[i] + 1];
  for (int64_t r = 0; r < t; ++r) first[r + 1] += first[r];
  {
    std::vector<int64_t> fill(first.begin(), first.end() - 1);
    for (int64_t i = 0; i < pairs; ++i) by_token[fill[token_of[i]]++] = i;
  }
  const float* w = wc.data_ptr<float>();
  at::Tensor out = at::empty({t, h}, x.options());
  auto combine = [&](auto* yp, auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    at::parallel_for(0, t, 1, [&](int64_t r0, int64_t r1) {
      std::vector<float> acc(h);
      for (int64_t r = r0; r < r1; ++r) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t q = first[r]; q < first[r + 1]; ++q) {
          const int64_t i = by_token[q];
          const float wt = tokenmill::round_to<T>(w[order[i]]);
          const T* yr = yp + i * h;
          for (int64_t c = 0; c < h; ++c) acc[c] += tokenmill::round_to<T>(tokenmill::to_float(yr[c]) * wt);
        }
        T* o = op + r * h;
        for (int64_t c = 0; c < h; ++c) o[c] = tokenmill::from_float<T>(acc[c]);
      }
    });
  };
  if (x.scalar_type() == at::kBFloat16) {
    combine(reinterpret_cast<const tokenmill::bf16*>(y.data_ptr()), reinterpret_cast<tokenmill::bf16*>(out.data_ptr()));
  } else {
    combine(y.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

// The path moe_experts takes here for a kind of weight ("bf16", "int8", "f32"): "AMX" (bf16 experts of
// 1..32 rows; AVX-512 for more), "AVX-512", "AVX2", or "none" (the Python loop runs).
std::string moe_path(c10::string_view kind) {
  TORCH_CHECK(kind == "bf16" || kind == "int8" || kind == "f32", "moe_path: kind must be 'bf16', 'int8' or 'f32'");
  const Isa path = path_of(kind == "bf16" ? Kind::Bf16 : kind == "int8" ? Kind::Int8 : Kind::F32);
  return path == Isa::Base ? "none" : tokenmill::isa_name(path);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("moe_path(str kind) -> str");
  m.def("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor[] gate_up, Tensor[] gate_up_scales, Tensor[] down, "
        "Tensor[] down_scales, int inter) -> Tensor");
  m.impl("moe_path", c10::DispatchKey::CatchAll, TORCH_FN(moe_path));
  m.impl("moe_experts", c10::DispatchKey::CPU, TORCH_FN(moe_experts));
}
