// The LoRA delta of one linear for every row of a step in one call (CPU):
//     y[t] += (A_s x[t]) B_s^T      for each row t on adapter s = slots[t] (-1: the base model)
// with A_s [R_s, in] and B_s^T [R_s, out] (the adapter's scale folded into B); an adapter that does
// not target the linear passes two empty tensors. x and y are float32 or both bf16, the pairs float32
// or (with bf16 rows) bf16, half the bytes a step reads: everything is widened on the fly, the delta
// summed in float32 and added to y's row in float32, rounded to bf16 once (PyTorch's bf16 products
// would round after each of the three ops). Registered as torch.ops.tokenmill.lora_add_
// (engine/lora/batch.py), and for the C++ decode loop as a table of functions (lora.h, lora_api).
//
// Why: the PyTorch form costs four dispatched ops per adapter and linear (gather the adapter's rows,
// two thin products, scatter-add): with 4 adapters on SmolLM2-135M's 30 layers, ~2,000 ops a decode
// step, mostly dispatch. Here one call per linear does every adapter in two phases: each row's R_s
// shrink sums (dot products over `in`, contiguous) into a small buffer, then per block of output
// columns each row's R_s scaled rows of B^T added into y (blocks go to the threads, so a one-row
// decode uses them all, and a block of B^T stays in L1 across one adapter's rows). A base-model row
// costs nothing.
//
// Spans: a fused linear's B^T is block-diagonal (engine/lora/adapter.py: q/k/v or gate/up side by side,
// each shard's ranks feeding only its own columns). Each segment may say where its B^T is non-zero,
// as rows (c0, c1, r0, r1): output columns [c0, c1) take ranks [r0, r1); the kernel reads and
// multiplies nothing else (columns outside every span get no delta), a third of qkv's and half of
// gate/up's expand at equal ranks. An empty spans tensor: the whole B^T.
//
// Paths (isa.h; the arithmetic in kernels/, kernels/lora.h): AMX for bf16 rows and pairs with `in` a
// multiple of 32 (kernels/lora_amx.cpp, in one parallel region here), AVX-512 and AVX2 register tiles
// (kernels/lora_avx512.cpp, lora_avx2.cpp: the shrink over groups of rows, then the expand over
// blocks of columns), and portable loops below for CPUs with neither. TOKENMILL_CPU_ISA caps the path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "isa.h"
#include "kernels/lora.h"
#include "lora.h"

namespace {

using tokenmill::Isa;
using tokenmill::LoraLinear;
using tokenmill::lora::AMX_ROWS;
using tokenmill::lora::COLS;
using tokenmill::lora::Group;
using tokenmill::lora::GROUP;
using tokenmill::lora::packed_a_size;
using tokenmill::lora::packed_b_size;
using tokenmill::lora::Span;
using tokenmill::lora::span_blocks;
using tokenmill::lora::span_steps;
using tokenmill::lora::Spans;
namespace amx = tokenmill::lora::amx;
using Bf = at::BFloat16;

// at::BFloat16 as the kernels' bf16 (the same two bytes)
inline const tokenmill::bf16* K(const Bf* p) { return reinterpret_cast<const tokenmill::bf16*>(p); }
inline tokenmill::bf16* K(Bf* p) { return reinterpret_cast<tokenmill::bf16*>(p); }
inline const Bf* K(const tokenmill::bf16* p) { return reinterpret_cast<const Bf*>(p); }

// The path of this process's deltas (AMX only where a call's rows and pairs are bf16, in % 32 == 0).
Isa path() {
  const tokenmill::CpuFeatures& f = tokenmill::cpu();
  return f.amx ? Isa::Amx : f.avx512 ? Isa::Avx512 : f.avx2 ? Isa::Avx2 : Isa::Base;
}

// Every per-call list of lora_add_, kept per thread across calls (their capacity reused): a decode step
// makes 120 calls, whose ~50 small allocations each cost ~1 ms a step of the master thread's time, the
// other threads waiting.
struct Scratch {
  LoraLinear lin;  // the op's call: its adapters (the decode loop's are prepared once: lora.h)
  std::vector<const tokenmill::bf16*> pa, pb;  // pairs in the tile layouts, where some are packed per call
  std::vector<std::vector<int64_t>> segments;  // each adapter's rows, in order
  std::vector<Group> groups;
  std::vector<int64_t> first_group;
  std::vector<uint16_t> terms;
  std::vector<int64_t> plain;  // rows without a delta (delta_amx's activation)
  std::vector<float> tmp;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// lin's A and B^T data as W (null where an adapter does not target the linear)
template <typename W>
const W* const* a_data(const LoraLinear& lin) { return reinterpret_cast<const W* const*>(lin.ap.data()); }
template <typename W>
const W* const* bt_data(const LoraLinear& lin) { return reinterpret_cast<const W* const*>(lin.bp.data()); }

// v's first n lists, each emptied (their capacity kept)
template <typename V>
void reset_lists(std::vector<V>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  for (size_t i = 0; i < n; ++i) v[i].clear();
}

// ---- AVX-512 / AVX2 register tiles -----------------------------------------------------------------

// Every adapter's rows (segments: row indices in order) in groups of GROUP: the shrink over groups, the
// expand over blocks of COLS output columns, both spread over the threads.
void delta_tiles(bool wide, void* yp, const void* xp, bool xy_bf16, const LoraLinear& lin, Scratch& sc) {
  std::vector<Group>& groups = sc.groups;
  groups.clear();
  int64_t adapted = 0;
  for (int64_t s = 0; s < lin.n; ++s) {
    if (lin.rank[s] == 0) continue;
    const int64_t k = static_cast<int64_t>(sc.segments[s].size());
    adapted += k;
    for (int64_t i = 0; i < k; i += GROUP) groups.push_back({s, i, static_cast<int>(std::min<int64_t>(GROUP, k - i))});
  }
  if (groups.empty()) return;
  const tokenmill::lora::Delta d{yp, xp, xy_bf16, &lin, &sc.segments, &groups, sc.tmp.data()};
  const int64_t work = adapted * lin.max_rank;  // multiply-adds per input or output column
  const int64_t ng = static_cast<int64_t>(groups.size());
  at::parallel_for(0, ng, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, work * lin.in / ng)),
                   [&](int64_t g0, int64_t g1) {
                     if (wide) {
                       tokenmill::lora::avx512::shrink_groups(d, g0, g1);
                     } else {
                       tokenmill::lora::avx2::shrink_groups(d, g0, g1);
                     }
                   });
  const int64_t blocks = (lin.out + COLS - 1) / COLS;
  at::parallel_for(0, blocks, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, work * COLS)),
                   [&](int64_t b0, int64_t b1) {
                     if (wide) {
                       tokenmill::lora::avx512::expand_blocks(d, b0, b1);
                     } else {
                       tokenmill::lora::avx2::expand_blocks(d, b0, b1);
                     }
                   });
}

// ---- AMX (bf16 rows and pairs): 16 rows of one adapter per tile ------------------------------------

// One adapter's pair in the tile layouts of kernels/lora.h (packed_a_size + packed_b_size elements).
void pack_pair(const Bf* a, const Bf* bt, int64_t R, int64_t in, int64_t out, const Spans& spans, Bf* pa, Bf* pb) {
  const int64_t kcs = in / 32;
  for (int64_t rt = 0; rt < (R + 15) / 16; ++rt)
    for (int64_t kc = 0; kc < kcs; ++kc) {
      Bf* d = pa + (rt * kcs + kc) * 512;
      for (int p = 0; p < 16; ++p)
        for (int r = 0; r < 16; ++r)
          for (int e = 0; e < 2; ++e) {
            const int64_t rank = 16 * rt + r;
            d[p * 32 + r * 2 + e] = rank < R ? a[rank * in + 32 * kc + 2 * p + e] : Bf(0.f);
          }
    }
  for (const Span& sp : spans) {
    if (sp.c0 >= sp.c1 || sp.r0 >= sp.r1) continue;
    const int64_t rw = sp.r0 & ~int64_t{15}, steps = span_steps(sp), blocks = span_blocks(sp);
    for (int64_t st = 0; st < steps; ++st)
      for (int64_t b = 0; b < blocks; ++b) {
        Bf* d = pb + (st * blocks + b) * 256;
        for (int p = 0; p < 8; ++p)
          for (int col = 0; col < 16; ++col)
            for (int e = 0; e < 2; ++e) {
              const int64_t rank = rw + 16 * st + 2 * p + e, o = sp.c0 + 16 * b + col;
              d[p * 32 + col * 2 + e] = rank >= sp.r0 && rank < sp.r1 && o < sp.c1 ? bt[rank * out + o] : Bf(0.f);
            }
      }
    pb += steps * blocks * 256;
  }
}

// The AMX path of a call: each adapter's pair in the tile layouts (pa, pb: given, else packed here),
// one parallel region (a decode step makes 120 of these calls: a second fork and join each would
// cost more than a shrink): thread t shrinks groups t, t + nt, ..., then expands those same groups
// over every column where there are enough groups to share, else (after a barrier) its share of the
// output columns for every adapter. lin: the call's adapters (pairs without a tile-layout copy are
// packed into sc for the call); sc: the call's lists. act: where y is a gated MLP's [gate | up] product,
// act[t] = silu(gate[t]) * up[t] (silu.h) for every row t of y after its delta, in the same parallel
// region; else null. Returns whether act was made (not where no row has an adapter that targets the
// linear).
bool delta_amx(Bf* yp, const Bf* xp, int64_t rows, const int64_t* slot, const LoraLinear& lin, Scratch& sc, Bf* act) {
  const int64_t in = lin.in, out = lin.out, n_ad = lin.n, max_rank = lin.max_rank;
  const Bf* const* ap = a_data<Bf>(lin);
  const Bf* const* bp = bt_data<Bf>(lin);
  const std::vector<std::vector<int64_t>>& segments = sc.segments;
  const std::vector<int64_t>& rank = lin.rank;
  const std::vector<Spans>& spans = lin.spans;
  const tokenmill::bf16* const* pa = lin.pa.data();
  const tokenmill::bf16* const* pb = lin.pb.data();
  std::vector<std::vector<Bf>> made;  // pairs packed for this call only (those without a tile-layout copy)
  for (int64_t s = 0; s < n_ad; ++s) {
    if (rank[s] == 0 || segments[s].empty() || (pa[s] != nullptr && pb[s] != nullptr)) continue;
    if (made.empty()) {
      sc.pa.assign(lin.pa.begin(), lin.pa.end());
      sc.pb.assign(lin.pb.begin(), lin.pb.end());
      pa = sc.pa.data(), pb = sc.pb.data();
    }
    made.emplace_back(static_cast<size_t>(packed_a_size(rank[s], in) + packed_b_size(spans[s])));
    Bf* base = made.back().data();
    pack_pair(ap[s], bp[s], rank[s], in, out, spans[s], base, base + packed_a_size(rank[s], in));
    sc.pa[s] = K(base), sc.pb[s] = K(base + packed_a_size(rank[s], in));
  }
  const int64_t rp = (max_rank + 15) / 16 * 16;  // a group's terms: [3][16][rp]
  std::vector<Group>& groups = sc.groups;
  std::vector<int64_t>& first_group = sc.first_group;
  groups.clear();
  first_group.assign(static_cast<size_t>(n_ad), -1);
  for (int64_t s = 0; s < n_ad; ++s) {
    if (rank[s] == 0) continue;
    const int64_t k = static_cast<int64_t>(segments[s].size());
    if (k > 0) first_group[s] = static_cast<int64_t>(groups.size());
    for (int64_t i = 0; i < k; i += AMX_ROWS)
      groups.push_back({s, i, static_cast<int>(std::min<int64_t>(AMX_ROWS, k - i))});
  }
  if (groups.empty()) return false;
  std::vector<int64_t>& plain = sc.plain;  // rows without a delta here: their activation is any thread's
  plain.clear();
  for (int64_t t = 0; act != nullptr && t < rows; ++t) {
    const int64_t s = slot[t];
    if (s < 0 || rank[s] == 0) plain.push_back(t);
  }
  const int64_t half = out / 2;
  auto activate = [&](int64_t t) { amx::activate(K(yp + t * out), K(act + t * half), half); };
  std::vector<uint16_t>& terms = sc.terms;  // zero: ranks past an adapter's own multiply zero rows of B
  terms.assign(groups.size() * 48 * static_cast<size_t>(rp), 0);
  constexpr int64_t COLS_AMX = 64;  // output columns per share of the expand
  const int64_t blocks = (out + COLS_AMX - 1) / COLS_AMX;
  const int threads = at::in_parallel_region() ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), blocks));
  const int64_t ng = static_cast<int64_t>(groups.size());
  // Enough groups to share evenly (4 adapters in a step, or one with 32 rows): each thread takes whole
  // groups, shrink then expand over every column, with no barrier (a group's rows are its thread's
  // alone; waiting at a barrier cost more than the imbalance of unequal groups). Else the threads share
  // the shrink's groups, then after a barrier the expand's columns.
  const bool by_group = threads > 1 && ng >= threads && (ng % threads == 0 || ng >= 3 * threads);
  auto work = [&](int t, int nt, auto&& barrier) {
    thread_local std::vector<Bf> xg;  // a group's rows gathered, kept across calls
    if (xg.size() < static_cast<size_t>(16 * in)) xg.resize(static_cast<size_t>(16 * in));
    int cfg = 0;
    for (int64_t g = t; g < ng; g += nt) {
      const Group& gr = groups[g];
      if (gr.n != cfg) amx::tiles_for_shrink(cfg = gr.n);
      amx::shrink(K(xp), segments[gr.s].data() + gr.first, gr.n, in, pa[gr.s], rank[gr.s], rp, K(xg.data()),
                  terms.data() + g * 48 * rp);
    }
    cfg = 0;
    if (by_group) {
      for (int64_t g = t; g < ng; g += nt) {
        const Group& gr = groups[g];
        amx::expand(K(yp), segments[gr.s], gr.first / AMX_ROWS, gr.first / AMX_ROWS + 1, out, pb[gr.s],
                    spans[gr.s], rp, terms.data() + first_group[gr.s] * 48 * rp, 0, out, cfg);
        // the group's rows are whole now (every column of their own thread's expand)
        for (int j = 0; act != nullptr && j < gr.n; ++j) activate(segments[gr.s][gr.first + j]);
      }
      amx::release();
      for (size_t i = t; act != nullptr && i < plain.size(); i += nt) activate(plain[i]);
      return;
    }
    barrier();
    const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
    for (int64_t s = 0; s < n_ad; ++s) {
      if (first_group[s] < 0 || b0 >= b1) continue;
      const int64_t k = static_cast<int64_t>(segments[s].size());
      amx::expand(K(yp), segments[s], 0, (k + AMX_ROWS - 1) / AMX_ROWS, out, pb[s], spans[s], rp,
                  terms.data() + first_group[s] * 48 * rp, b0 * COLS_AMX, std::min(out, b1 * COLS_AMX), cfg);
    }
    amx::release();
    if (act == nullptr) return;
    barrier();  // every row's columns whole
    for (int64_t r = rows * t / nt; r < rows * (t + 1) / nt; ++r) activate(r);
  };
  if (threads <= 1) {
    work(0, 1, [] {});
    return act != nullptr;
  }
#pragma omp parallel num_threads(threads)
  work(omp_get_thread_num(), omp_get_num_threads(), [] {
#pragma omp barrier
  });
  return act != nullptr;
}
// ---- portable loops (CPUs without AVX2) ---------------------------------------------------------------

constexpr int64_t SHRINK_GRAIN = 8;  // rows per shrink task: fewer run inline (no parallel region)

// Phase 1, shrink: tmp[t, :R_s] = A_s x[t] for each adapted row, parallel over rows.
template <typename T, typename W>
void shrink(const T* xp, int64_t rows, int64_t in, const int64_t* slot, const W* const* ap,
            const std::vector<int64_t>& rank, int64_t max_rank, float* tmp) {
  at::parallel_for(0, rows, SHRINK_GRAIN, [&](int64_t t0, int64_t t1) {
    std::vector<float> xf(static_cast<size_t>(in));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = slot[t];
      if (s < 0 || rank[s] == 0) continue;
      const T* __restrict xr = xp + t * in;
      float* __restrict xw = xf.data();
      for (int64_t c = 0; c < in; ++c) xw[c] = static_cast<float>(xr[c]);
      for (int64_t r = 0; r < rank[s]; ++r) {
        const W* __restrict ar = ap[s] + r * in;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)  // vectorised: the sum's order is the compiler's lanes, then theirs
        for (int64_t c = 0; c < in; ++c) acc += static_cast<float>(ar[c]) * xw[c];
        tmp[t * max_rank + r] = acc;
      }
    }
  });
}

// Phase 2, expand: y[t, cols] += tmp[t, :R_s] B_s^T[:, cols], parallel over blocks of COLS output
// columns (so one row's expand uses every thread too); within a block the rows in order, so a run of
// one adapter's rows reuses its B^T tile from L1. Each output element: y, then + tmp[r] * B^T[r] for
// the ranks r of its span in order, in float32, one store (bf16: one rounding).
template <typename T, typename W>
void expand(T* yp, int64_t rows, int64_t out, const int64_t* slot, const W* const* bp,
            const std::vector<int64_t>& rank, const std::vector<Spans>& spans, int64_t max_rank, const float* tmp) {
  const int64_t blocks = (out + COLS - 1) / COLS;
  // at least ~32k multiply-adds a task: below that the parallel region costs more than the work
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, rows * max_rank * COLS));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) float acc[COLS];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o0 = b * COLS, w = std::min(COLS, out - o0);
      for (int64_t t = 0; t < rows; ++t) {
        const int64_t s = slot[t];
        if (s < 0 || rank[s] == 0) continue;
        for (const Span& sp : spans[s]) {  // the span's part of the block, its ranks only
          const int64_t c0 = std::max(o0, sp.c0), c1 = std::min(o0 + w, sp.c1);
          if (c0 >= c1 || sp.r0 >= sp.r1) continue;
          T* __restrict yr = yp + t * out + c0;
          for (int64_t o = 0; o < c1 - c0; ++o) acc[o] = static_cast<float>(yr[o]);
          for (int64_t r = sp.r0; r < sp.r1; ++r) {
            const float v = tmp[t * max_rank + r];
            const W* __restrict br = bp[s] + r * out + c0;
            for (int64_t o = 0; o < c1 - c0; ++o) acc[o] += v * static_cast<float>(br[o]);
          }
          for (int64_t o = 0; o < c1 - c0; ++o) yr[o] = static_cast<T>(acc[o]);
        }
      }
    }
  });
}


// Whether bf16 rows' deltas for lin run on the tile unit (delta_amx).
bool amx_delta(const LoraLinear& lin) { return lin.bf16 && lin.in % 32 == 0 && path() == Isa::Amx; }

// lin: the call's adapters (lora.h); sc: the call's lists; act: see delta_amx (bf16 on the tile unit
// only). Returns whether act was made.
template <typename T, typename W>
bool delta_rows(T* yp, const T* xp, int64_t rows, const int64_t* slot, const LoraLinear& lin, Scratch& sc,
                T* act = nullptr) {
  reset_lists(sc.segments, static_cast<size_t>(lin.n));
  for (int64_t t = 0; t < rows; ++t)
    if (slot[t] >= 0) sc.segments[slot[t]].push_back(t);
  if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<W, at::BFloat16>) {
    // the tile unit whatever the rows (one row on one adapter costs ~10% more than on the AVX-512
    // tiles, two rows or more adapters less), so a row's delta never depends on its neighbours
    // (batch-invariant mode): every path sums each row in its own fixed order
    if (amx_delta(lin)) return delta_amx(yp, xp, rows, slot, lin, sc, act);
  }
  sc.tmp.resize(static_cast<size_t>(rows * lin.max_rank));
  const Isa p = path();
  if (p >= Isa::Avx2) {
    delta_tiles(p >= Isa::Avx512, yp, xp, std::is_same_v<T, at::BFloat16>, lin, sc);
    return false;
  }
  shrink(xp, rows, lin.in, slot, a_data<W>(lin), lin.rank, lin.max_rank, sc.tmp.data());
  expand(yp, rows, lin.out, slot, bt_data<W>(lin), lin.rank, lin.spans, lin.max_rank, sc.tmp.data());
  return false;
}

using Tensors = c10::ArrayRef<at::Tensor>;  // a list of the call's, or a part of the decode loop's: no copies

// lora.h: one linear's lists checked into lin (its vectors' capacity reused). in, out: -1 to take them
// from the adapters.
void prepare(LoraLinear& lin, int64_t in, int64_t out, Tensors a, Tensors bt, Tensors spans_in, Tensors packed_in) {
  TORCH_CHECK(a.size() == bt.size(), "lora_add_: one A and one B^T per adapter");
  TORCH_CHECK(spans_in.empty() || spans_in.size() == a.size(), "lora_add_: one spans tensor per adapter (or none)");
  TORCH_CHECK(packed_in.empty() || packed_in.size() == a.size(), "lora_add_: one packed tensor per adapter (or none)");
  const int64_t n = static_cast<int64_t>(a.size());
  lin.n = n, lin.max_rank = 0, lin.any = false;
  std::vector<int64_t>& rank = lin.rank;
  rank.assign(static_cast<size_t>(n), 0);
  lin.ap.assign(static_cast<size_t>(n), nullptr);
  lin.bp.assign(static_cast<size_t>(n), nullptr);
  for (int64_t s = 0; s < n; ++s) {
    if (a[s].numel() == 0 && bt[s].numel() == 0) continue;  // an adapter that does not target this linear
    const at::ScalarType st = a[s].scalar_type();
    TORCH_CHECK(a[s].device().is_cpu() && bt[s].device().is_cpu() && (st == at::kFloat || st == at::kBFloat16) &&
                    (!lin.any || lin.bf16 == (st == at::kBFloat16)) && bt[s].scalar_type() == st,
                "lora_add_: A and B^T must be float32 (or bf16 with bf16 rows) CPU tensors, one dtype for every "
                "adapter");
    TORCH_CHECK(a[s].dim() == 2 && a[s].is_contiguous() && bt[s].dim() == 2 && bt[s].is_contiguous(),
                "lora_add_: A must be contiguous [R, in], B^T contiguous [R, out]");
    if (in < 0) in = a[s].size(1);
    if (out < 0) out = bt[s].size(1);
    TORCH_CHECK(a[s].size(1) == in, "lora_add_: A must be contiguous [R, in]");
    TORCH_CHECK(bt[s].size(1) == out && bt[s].size(0) == a[s].size(0),
                "lora_add_: B^T must be contiguous [R, out] with A's rank");
    lin.any = true, lin.bf16 = st == at::kBFloat16;
    rank[s] = a[s].size(0);
    lin.max_rank = std::max(lin.max_rank, rank[s]);
    lin.ap[s] = a[s].data_ptr();
    lin.bp[s] = bt[s].data_ptr();
  }
  lin.in = in, lin.out = out;
  std::vector<Spans>& spans = lin.spans;
  reset_lists(spans, static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) {
    if (rank[s] == 0) continue;
    const at::Tensor* sp = !spans_in.empty() && spans_in[s].numel() > 0 ? &spans_in[s] : nullptr;
    if (sp == nullptr) {
      spans[s].push_back({0, out, 0, rank[s]});
      continue;
    }
    TORCH_CHECK(sp->scalar_type() == at::kLong && sp->dim() == 2 && sp->size(1) == 4 && sp->is_contiguous(),
                "lora_add_: spans must be contiguous int64 [S, 4] rows (c0, c1, r0, r1)");
    const int64_t* v = sp->data_ptr<int64_t>();
    for (int64_t i = 0; i < sp->size(0); ++i) {
      const Span q{v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]};
      TORCH_CHECK(0 <= q.c0 && q.c0 <= q.c1 && q.c1 <= out && 0 <= q.r0 && q.r0 <= q.r1 && q.r1 <= rank[s],
                  "lora_add_: span ", i, " of adapter ", s, " (", q.c0, ", ", q.c1, ", ", q.r0, ", ", q.r1,
                  ") is outside B^T [", rank[s], ", ", out, "]");
      TORCH_CHECK(i == 0 || q.c0 >= spans[s].back().c1, "lora_add_: spans of adapter ", s,
                  " must be in column order without overlap");
      spans[s].push_back(q);
    }
  }
  // each adapter's pair in the tile layouts (lora_pack_bf16), where given: [A's, then B^T's]
  lin.pa.assign(static_cast<size_t>(n), nullptr);
  lin.pb.assign(static_cast<size_t>(n), nullptr);
  for (int64_t s = 0; s < n && !packed_in.empty(); ++s) {
    const at::Tensor& pk = packed_in[s];
    if (rank[s] == 0 || pk.numel() == 0) continue;
    const int64_t na = in % 32 == 0 ? packed_a_size(rank[s], in) : -1, nb = packed_b_size(spans[s]);
    TORCH_CHECK(pk.scalar_type() == at::kBFloat16 && pk.dim() == 1 && pk.is_contiguous() && pk.numel() == na + nb,
                "lora_add_: packed pair of adapter ", s, " must be lora_pack_bf16's bf16 vector for these shapes "
                "and spans (", na + nb, " elements)");
    lin.pa[s] = K(pk.data_ptr<at::BFloat16>());
    lin.pb[s] = lin.pa[s] + na;
  }
}

// y += the delta of lin's adapters (prepared) on x's rows by slot; act: see delta_amx (the caller checked
// silu_fusable). Returns whether act was made.
bool add_linear(at::Tensor& y, const at::Tensor& x, const LoraLinear& lin, const at::Tensor& slots, Scratch& sc,
                at::BFloat16* act = nullptr) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && (bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2 && x.is_contiguous(),
              "lora_add_: x must be a contiguous float32 or bf16 CPU matrix [T, in]");
  TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == x.scalar_type() && y.dim() == 2 && y.is_contiguous() &&
                  y.size(0) == x.size(0),
              "lora_add_: y must be a contiguous CPU matrix [T, out] of x's dtype with x's rows");
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                  slots.numel() == x.size(0) && slots.is_contiguous(),
              "lora_add_: slots must be int64 [T]");
  const int64_t rows = x.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < lin.n, "lora_add_: slot ", slot[t], " of row ", t, " is out of range");
  if (!lin.any) return false;  // no adapter targets this linear
  TORCH_CHECK(x.size(1) == lin.in, "lora_add_: x has ", x.size(1), " columns where the adapters' A [R, in] has ",
              lin.in);
  TORCH_CHECK(y.size(1) == lin.out, "lora_add_: y has ", y.size(1), " columns where the adapters' B^T [R, out] has ",
              lin.out);
  TORCH_CHECK(!lin.bf16 || bf16,
              "lora_add_: A and B^T must be float32 (or bf16 with bf16 rows), one dtype for every adapter");
  if (bf16) {
    auto* yp = y.data_ptr<at::BFloat16>();
    const auto* xp = x.data_ptr<at::BFloat16>();
    if (lin.bf16) return delta_rows<at::BFloat16, at::BFloat16>(yp, xp, rows, slot, lin, sc, act);
    delta_rows<at::BFloat16, float>(yp, xp, rows, slot, lin, sc);
  } else {
    delta_rows<float, float>(y.data_ptr<float>(), x.data_ptr<float>(), rows, slot, lin, sc);
  }
  return false;
}

// Whether lora_add_linear_silu takes the activation of lin's product for rows like x (lora.h).
bool silu_fusable(const LoraLinear& lin, const at::Tensor& x) {
  return lin.any && x.scalar_type() == at::kBFloat16 && lin.out % 2 == 0 && amx_delta(lin);
}

void add_linear_silu(at::Tensor& y, const at::Tensor& x, const LoraLinear& lin, const at::Tensor& slots,
                     at::Tensor& act, Scratch& sc) {
  TORCH_CHECK(silu_fusable(lin, x), "lora_add_linear_silu: not for these adapters and rows (silu_fusable)");
  const int64_t rows = x.size(0), half = lin.out / 2;
  TORCH_CHECK(act.scalar_type() == at::kBFloat16 && act.is_contiguous() && act.dim() == 2 && act.size(0) == rows &&
                  act.size(1) == half,
              "lora_add_linear_silu: act must be a contiguous bf16 [T, out / 2]");
  at::BFloat16* ap = act.data_ptr<at::BFloat16>();
  if (add_linear(y, x, lin, slots, sc, ap)) return;
  // no row had a delta here: the activation alone
  const Bf* src = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, half)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) amx::activate(K(src + r * lin.out), K(ap + r * half), half);
  });
}

void lora_add_(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& bt,
               const at::Tensor& slots, const c10::optional<std::vector<at::Tensor>>& spans_in,
               const c10::optional<std::vector<at::Tensor>>& packed_in) {
  Scratch& sc = scratch();
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2, "lora_add_: x must be a contiguous float32 or bf16 CPU matrix [T, in]");
  prepare(sc.lin, x.size(1), y.size(1), a, bt, spans_in ? Tensors(*spans_in) : Tensors(),
          packed_in ? Tensors(*packed_in) : Tensors());
  add_linear(y, x, sc.lin, slots, sc);
}

// One adapter's pair in the tile layouts of the AMX path (pack_pair), as one bf16 vector: A's, then
// B^T's spans'. a: [R, in] bf16 with in a multiple of 32; bt: [R, out] bf16; spans as lora_add_'s.
at::Tensor lora_pack_bf16(const at::Tensor& a, const at::Tensor& bt, const at::Tensor& spans_t) {
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && bt.scalar_type() == at::kBFloat16 && a.dim() == 2 && bt.dim() == 2 &&
                  a.is_contiguous() && bt.is_contiguous() && a.size(0) == bt.size(0) && a.size(1) % 32 == 0,
              "lora_pack_bf16: A [R, in] and B^T [R, out], contiguous bf16, in a multiple of 32");
  const int64_t R = a.size(0), in = a.size(1), out = bt.size(1);
  Spans spans;
  if (spans_t.numel() == 0) {
    spans.push_back({0, out, 0, R});
  } else {
    TORCH_CHECK(spans_t.scalar_type() == at::kLong && spans_t.dim() == 2 && spans_t.size(1) == 4 && spans_t.is_contiguous(),
                "lora_pack_bf16: spans must be contiguous int64 [S, 4]");
    const int64_t* v = spans_t.data_ptr<int64_t>();
    for (int64_t i = 0; i < spans_t.size(0); ++i) {
      const Span q{v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]};
      TORCH_CHECK(0 <= q.c0 && q.c0 <= q.c1 && q.c1 <= out && 0 <= q.r0 && q.r0 <= q.r1 && q.r1 <= R,
                  "lora_pack_bf16: span ", i, " is outside B^T");
      spans.push_back(q);
    }
  }
  at::Tensor packed = at::empty({packed_a_size(R, in) + packed_b_size(spans)}, a.options());
  at::BFloat16* base = packed.data_ptr<at::BFloat16>();
  pack_pair(a.data_ptr<at::BFloat16>(), bt.data_ptr<at::BFloat16>(), R, in, out, spans, base,
            base + packed_a_size(R, in));
  return packed;
}

// Whether bf16 deltas may run on the tile unit (so a prompt chunk's hundreds of rows beat PyTorch's
// products too: engine/lora/batch.py).
bool lora_amx() { return path() == Isa::Amx; }

// The path this process's deltas take: "AMX" (bf16 rows and pairs; AVX-512 for the rest), "AVX-512",
// "AVX2", or "portable".
std::string lora_path() { return tokenmill::isa_name(path()); }

void add_linear_api(at::Tensor& y, const at::Tensor& x, const LoraLinear& lin, const at::Tensor& slots) {
  add_linear(y, x, lin, slots, scratch());
}

void add_linear_silu_api(at::Tensor& y, const at::Tensor& x, const LoraLinear& lin, const at::Tensor& slots,
                         at::Tensor& act) {
  add_linear_silu(y, x, lin, slots, act, scratch());
}

// The decode loop's table (lora.h), as an address it asks for once.
int64_t lora_api() {
  static const tokenmill::LoraApi api{prepare, add_linear_api, silu_fusable, add_linear_silu_api};
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(&api));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] bt, Tensor slots, Tensor[]? spans=None, "
        "Tensor[]? packed=None) -> ()");
  m.impl("lora_add_", c10::DispatchKey::CPU, TORCH_FN(lora_add_));
  m.def("lora_amx() -> bool", &lora_amx);
  m.def("lora_path() -> str", &lora_path);
  m.def("lora_api() -> int", &lora_api);
  m.def("lora_pack_bf16(Tensor a, Tensor bt, Tensor spans) -> Tensor");
  m.impl("lora_pack_bf16", c10::DispatchKey::CPU, TORCH_FN(lora_pack_bf16));
}
