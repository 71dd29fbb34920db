// The decoder stack of a decode-only step in one call (small batches on the CPU).
//
// A decode step of a 30-layer model makes about 400 small calls from Python (norms, linears, rotary,
// the KV store, the attention kernels, views), each paying the interpreter and the dispatcher: ~2-3 ms
// a step, a fifth of a batch-1 step. This loop makes the same calls, to the same kernels (the other
// tokenmill ops, oneDNN's packed linear, ATen), in the same order, from C++, so its results are the
// Python layers' bit for bit (tests/engine/test_fused_decode.py); engine/models/fused_decode.py decides
// when it applies and lays out its arguments.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "lora.h"

namespace {

// How one linear runs for this step's row count (engine/models/fused_decode.py picks it).
enum Kind : int64_t {
  PLAIN = 0,      // at::linear(x, w, bias)
  ONEDNN = 1,     // mkldnn::_linear_pointwise(x, packed w, bias)
  GEMV = 2,       // tokenmill::gemv(x, packed w, scales?, n, k, bias)
  GEMV_SILU = 3,  // tokenmill::gemv_silu_mul: a gated MLP's gate/up, silu(gate) * up out
  GEMV_F32 = 4,   // tokenmill::gemv_f32(x, packed w, n, k, bias): float32 (cpu_gemv_f32.cpp)
  GEMV_BLOCKED = 5,  // tokenmill::gemv_blocked(x, packed w, n, k, bias): bf16 in oneDNN's order
  GEMV_SPLIT = 6,  // tokenmill::gemv_split: an interleaved gate/up's plain [gate | up] product (LoRA steps)
  GGML = 7,        // tokenmill::ggml_gemv(x, blocks, type, n, k, bias): GGUF blocks, float32 activations
  GGML_Q8 = 8,     // tokenmill::ggml_gemv_q8: GGUF blocks, int8 activations (engine/models/gguf_linear.py)
};

// Per layer, SLOTS optional tensors in this order (fused_decode.py LAYER_SLOTS). A Gemma layer's norms are
// its input, post-attention, Q, K, pre- and post-feedforward ones, each as (1 + weight) in float32.
enum Slot : int64_t {
  IN_NORM = 0, POST_NORM, Q_NORM, K_NORM,
  QKV_W, QKV_SCALES, QKV_BIAS,
  O_W, O_SCALES, O_BIAS,
  GU_W, GU_SCALES, GU_BIAS,
  DOWN_W, DOWN_SCALES, DOWN_BIAS,
  PRE_FF_NORM, POST_FF_NORM,  // Gemma only
  SLOTS,
};
// Per layer, LINEARS kinds, LINEARS (n, k) pairs and LINEARS ggml type ids (GGML kinds; 0 otherwise):
// qkv, o, gate/up, down.
constexpr int64_t LINEARS = 4;

c10::OperatorHandle op(const char* name) {  // by value: the dispatcher hands out a handle, not a reference
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor call1(const c10::OperatorHandle& h, std::vector<c10::IValue> args) {
  h.callBoxed(&args);
  return args.empty() ? at::Tensor() : args[0].toTensor();
}

// Each op resolved on first use (an op of an optional source, or oneDNN's, is only looked up where used).
#define TOKENMILL_OP(fn, name)                        \
  const c10::OperatorHandle& fn() {                   \
    static const c10::OperatorHandle h = op(name);   \
    return h;                                         \
  }
TOKENMILL_OP(gemv_op, "tokenmill::gemv")
TOKENMILL_OP(gemv_silu_op, "tokenmill::gemv_silu_mul")
TOKENMILL_OP(gemv_f32_op, "tokenmill::gemv_f32")
TOKENMILL_OP(gemv_blocked_op, "tokenmill::gemv_blocked")
TOKENMILL_OP(gemv_split_op, "tokenmill::gemv_split")
TOKENMILL_OP(rms_norm_op, "tokenmill::rms_norm")
TOKENMILL_OP(add_rms_norm_op, "tokenmill::add_rms_norm")
TOKENMILL_OP(rotary_op, "tokenmill::rotary_inplace")
TOKENMILL_OP(store_op, "tokenmill::paged_store_kv")
TOKENMILL_OP(attention_op, "tokenmill::paged_decode_attention")
TOKENMILL_OP(onednn_op, "mkldnn::_linear_pointwise")
TOKENMILL_OP(ggml_op, "tokenmill::ggml_gemv")
TOKENMILL_OP(ggml_q8_op, "tokenmill::ggml_gemv_q8")
#undef TOKENMILL_OP

using Weights = c10::List<c10::optional<at::Tensor>>;

at::Tensor get(const Weights& w, int64_t layer, int64_t slot) {
  return w.get(layer * SLOTS + slot).value();
}

c10::IValue opt(const Weights& w, int64_t layer, int64_t slot) {
  c10::optional<at::Tensor> t = w.get(layer * SLOTS + slot);
  return t.has_value() ? c10::IValue(*t) : c10::IValue();
}

// One linear (slots base..base+2: weight, scales, bias); its output, silu(gate) * up for GEMV_SILU.
at::Tensor linear(const at::Tensor& x, const Weights& w, int64_t layer, int64_t base, int64_t kind, int64_t n,
                  int64_t k, int64_t type) {
  const at::Tensor weight = get(w, layer, base);
  const c10::IValue scales = opt(w, layer, base + 1), bias = opt(w, layer, base + 2);
  switch (kind) {
    case PLAIN: {
      c10::optional<at::Tensor> b = w.get(layer * SLOTS + base + 2);
      return at::linear(x, weight, b);
    }
    case ONEDNN:
      return call1(onednn_op(), {x, weight, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                                 std::string("")});
    case GEMV:
      return call1(gemv_op(), {x, weight, scales, n, k, bias});
    case GEMV_SILU:
      return call1(gemv_silu_op(), {x, weight, scales, n, k, bias});
    case GEMV_F32:
      return call1(gemv_f32_op(), {x, weight, n, k, bias});
    case GEMV_BLOCKED:
      return call1(gemv_blocked_op(), {x, weight, n, k, bias});
    case GEMV_SPLIT:
      return call1(gemv_split_op(), {x, weight, scales, n, k, bias});
    case GGML:
      return call1(ggml_op(), {x, weight, type, n, k, bias});
    case GGML_Q8:
      return call1(ggml_q8_op(), {x, weight, type, n, k, bias});
    default:
      TORCH_CHECK(false, "decode_layers: unknown linear kind ", kind);
  }
}

// RMSNorm as engine/models/layers.py computes it: the fused kernel, or in float32 then scaled.
at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps, bool fused) {
  if (fused) return call1(rms_norm_op(), {x.contiguous(), w, eps});
  const auto dtype = x.scalar_type();
  const at::Tensor xf = at::rms_norm(x.to(at::kFloat), {x.size(-1)}, c10::nullopt, eps);
  return w * xf.to(dtype);
}

// Gemma's RMSNorm as engine/models/gemma.py GemmaRMSNorm computes it: normalised and scaled in float32,
// then cast; w1 is its (1 + weight) in float32 (fused_decode.py adds the 1 once: the same bits).
at::Tensor gemma_norm(const at::Tensor& x, const at::Tensor& w1, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean({-1}, true) + eps);
  return (normed * w1).to(x.scalar_type());
}

// The residual stream after adding x and its norm (layers.py RMSNorm.add_norm): (norm, stream).
// gemma: the norm is gemma_norm (never the fused kernel: it scales by weight).
std::pair<at::Tensor, at::Tensor> add_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                           double eps, bool fused, bool gemma = false) {
  if (gemma) {
    const at::Tensor stream = residual.defined() ? residual + x : x;
    return {gemma_norm(stream, w, eps), stream};
  }
  if (!residual.defined()) return {norm(x, w, eps, fused), x};
  if (fused) return {call1(add_rms_norm_op(), {x, residual, w, eps}), residual};
  const at::Tensor stream = residual + x;
  return {norm(stream, w, eps, fused), stream};
}

// RoPE as layers.py rotate(): x * cos + rotate_half(x) * sin.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  auto halves = x.chunk(2, -1);
  return x * cos + at::cat({-halves[1], halves[0]}, -1) * sin;
}

// The LoRA group's table (lora.h), once that group is loaded; null before (a LoraSet then refuses).
const tokenmill::LoraApi* lora_api() {
  static std::atomic<const tokenmill::LoraApi*> api{nullptr};
  if (api.load() == nullptr) {
    const auto h = c10::Dispatcher::singleton().findSchema({"tokenmill::lora_api", ""});
    if (!h.has_value()) return nullptr;
    std::vector<c10::IValue> stack;
    h->callBoxed(&stack);
    api.store(reinterpret_cast<const tokenmill::LoraApi*>(static_cast<intptr_t>(stack.at(0).toInt())));
  }
  return api.load();
}

// tokenmill::silu_mul, where the linear group loaded
const c10::optional<c10::OperatorHandle>& silu_mul_op() {
  static const c10::optional<c10::OperatorHandle> h = c10::Dispatcher::singleton().findSchema({"tokenmill::silu_mul", ""});
  return h;
}

// Whether silu_mul takes tokenmill::silu_mul for gu.
bool kernel_silu(const at::Tensor& gu) {
  return silu_mul_op().has_value() && gu.scalar_type() == at::kBFloat16 && gu.stride(1) == 1;
}

// silu(gate) * up of [T, 2I] = [gate | up]: tokenmill::silu_mul for bf16 where the linear group loaded (the
// fused product's arithmetic; engine/models/layers.py GatedMLP makes the same choice), else PyTorch's.
at::Tensor silu_mul(const at::Tensor& gu) {
  if (kernel_silu(gu)) return call1(*silu_mul_op(), {gu});
  auto gate_up = gu.chunk(2, -1);
  return at::silu(gate_up[0]) * gate_up[1];
}

// gelu(gate, tanh approximation) * up of [T, 2I] = [gate | up] (gemma.py gelu_tanh_mul: Gemma's GeGLU).
at::Tensor gelu_tanh_mul(const at::Tensor& gu) {
  auto gate_up = gu.chunk(2, -1);
  return at::gelu(gate_up[0], "tanh") * gate_up[1];
}

// A set of adapters' operands for the loop (torch.classes.tokenmill.LoraSet, made by
// engine/models/fused_decode.py once per set of adapters in segment order, kept across its steps):
// per layer and linear (qkv, o, gate/up, down), one A, B^T, spans and tile-layout tensor per segment
// (engine/lora/batch.py), checked once into each linear's LoraLinear (lora.h). Holds the tensors the
// linears point into.
struct LoraSet : torch::CustomClassHolder {
  std::vector<at::Tensor> a, bt, spans, packed;
  int64_t segments;
  std::vector<tokenmill::LoraLinear> linears;  // [layer * LINEARS + which]

  LoraSet(std::vector<at::Tensor> a_, std::vector<at::Tensor> bt_, std::vector<at::Tensor> spans_,
          std::vector<at::Tensor> packed_, int64_t segments_)
      : a(std::move(a_)), bt(std::move(bt_)), spans(std::move(spans_)), packed(std::move(packed_)), segments(segments_) {
    TORCH_CHECK(segments > 0 && a.size() % (LINEARS * segments) == 0 && bt.size() == a.size() &&
                    spans.size() == a.size() && packed.size() == a.size(),
                "LoraSet: A, B^T, spans and packed tensors for every layer, linear and segment");
    const tokenmill::LoraApi* api = lora_api();
    TORCH_CHECK(api != nullptr, "LoraSet: the LoRA kernels are not loaded (engine/kernels/cpu_kernels.py, group 'lora')");
    linears.resize(a.size() / segments);
    for (size_t i = 0; i < linears.size(); ++i) {
      auto part = [&](const std::vector<at::Tensor>& all) {
        return c10::ArrayRef<at::Tensor>(all.data() + i * segments, static_cast<size_t>(segments));
      };
      api->prepare(linears[i], -1, -1, part(a), part(bt), part(spans), part(packed));
    }
  }
  int64_t layers() const { return static_cast<int64_t>(linears.size()) / LINEARS; }
};

// The step's adapters: the set and each row's segment (-1: the base model); none when set is null.
struct Lora {
  const LoraSet* set;
  const c10::optional<at::Tensor>& slots;

  // y += the adapters' delta of linear `which` of layer l on its input x (tokenmill::lora_add_'s).
  void add(const at::Tensor& y, const at::Tensor& x, int64_t l, int64_t which) const {
    if (set == nullptr) return;
    at::Tensor out = y;
    lora_api()->add_linear(out, x, set->linears[static_cast<size_t>(l * LINEARS + which)], *slots);
  }

  // silu(gate) * up of gu (layer l's [gate | up] product of x) after the adapters' delta, from the
  // delta's own parallel region where lora_silu_fusable (act defined), else undefined: the caller adds
  // the delta and the activation apart. Only where silu_mul below would take tokenmill::silu_mul
  // (the same arithmetic).
  at::Tensor add_silu(const at::Tensor& gu, const at::Tensor& x, int64_t l) const {
    if (set == nullptr || !kernel_silu(gu)) return at::Tensor();
    const tokenmill::LoraLinear& lin = set->linears[static_cast<size_t>(l * LINEARS + 2)];
    if (!gu.is_contiguous() || !lora_api()->silu_fusable(lin, x)) return at::Tensor();
    at::Tensor out = gu, act = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
    lora_api()->add_linear_silu(out, x, lin, *slots, act);
    return act;
  }
};

}  // namespace

// x: [B, hidden] (embeddings of B decoding sequences); cos, sin: [B, 1, D]. Returns (x, residual) after
// the last layer, as LlamaModel's loop leaves them (the final norm is the caller's).
// gemma: Gemma 2/3 layers (engine/models/gemma.py Gemma2DecoderLayer): (1 + weight) norms in float32 before
// and after attention and the MLP, GeGLU; softcap: the attention-logit cap (0: none); cos_local, sin_local:
// the local layers' RoPE tables (Gemma 3), taken by each layer whose local_rope entry is 1.
std::vector<at::Tensor> decode_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                      const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                                      const std::vector<at::Tensor>& slot_mappings,
                                      const std::vector<at::Tensor>& tables, const at::Tensor& lens,
                                      int64_t block_size, int64_t max_context, double scale, const Weights& weights,
                                      c10::IntArrayRef kinds, c10::IntArrayRef shapes, int64_t heads, int64_t kv_heads,
                                      int64_t head_dim, double eps, bool fused_norm, bool qk_norm,
                                      const c10::optional<c10::intrusive_ptr<LoraSet>>& lora_set,
                                      const c10::optional<at::Tensor>& lora_slots, c10::IntArrayRef windows,
                                      c10::IntArrayRef ggml_types, bool gemma, double softcap,
                                      const c10::optional<at::Tensor>& cos_local,
                                      const c10::optional<at::Tensor>& sin_local, c10::IntArrayRef local_rope) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == layers * SLOTS &&
                  static_cast<int64_t>(kinds.size()) == layers * LINEARS &&
                  static_cast<int64_t>(shapes.size()) == layers * LINEARS * 2 &&
                  static_cast<int64_t>(windows.size()) == layers &&
                  static_cast<int64_t>(ggml_types.size()) == layers * LINEARS &&
                  static_cast<int64_t>(slot_mappings.size()) == layers &&
                  static_cast<int64_t>(tables.size()) == layers &&
                  static_cast<int64_t>(local_rope.size()) == layers,
              "decode_layers: one set of caches, weights, kinds, shapes, ggml types, windows, slots, tables and "
              "local-rope flags per layer");
  TORCH_CHECK(cos_local.has_value() == sin_local.has_value(), "decode_layers: both local RoPE tables or neither");
  TORCH_CHECK(!lora_set.has_value() || (lora_slots.has_value() && (*lora_set)->layers() == layers),
              "decode_layers: LoRA operands for every layer, and the rows' slots");
  const Lora lora{lora_set.has_value() ? lora_set->get() : nullptr, lora_slots};
  const int64_t b = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  at::Tensor residual;  // undefined before layer 0, as LlamaModel's None
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* kind = kinds.data() + l * LINEARS;
    const int64_t* nk = shapes.data() + l * LINEARS * 2;
    const int64_t* gt = ggml_types.data() + l * LINEARS;
    auto [h, stream] = add_norm(x, residual, get(weights, l, IN_NORM), eps, fused_norm, gemma);
    residual = stream;
    // Attention (llama.py LlamaAttention.forward).
    const at::Tensor qkv = linear(h, weights, l, QKV_W, kind[0], nk[0], nk[1], gt[0]);  // [B, (H + 2 Hkv) D]
    lora.add(qkv, h, l, 0);
    const at::Tensor v = qkv.slice(1, q_size + kv_size).view({b, kv_heads, head_dim});
    at::Tensor q, k;
    if (qk_norm) {
      const at::Tensor qv = qkv.slice(1, 0, q_size).view({b, heads, head_dim});
      const at::Tensor kv = qkv.slice(1, q_size, q_size + kv_size).view({b, kv_heads, head_dim});
      if (gemma) {
        q = gemma_norm(qv, get(weights, l, Q_NORM), eps);
        k = gemma_norm(kv, get(weights, l, K_NORM), eps);
      } else {
        q = norm(qv, get(weights, l, Q_NORM), eps, fused_norm);
        k = norm(kv, get(weights, l, K_NORM), eps, fused_norm);
      }
      // Gemma 3's local layers: their own RoPE base (gemma.py Gemma3Attention.rotate)
      const bool local = local_rope[l] != 0 && cos_local.has_value();
      const at::Tensor& c = local ? *cos_local : cos;
      const at::Tensor& s = local ? *sin_local : sin;
      q = rotate(q, c, s);
      k = rotate(k, c, s);
    } else {  // q and k side by side: one RoPE in place over [B, H + Hkv, D]
      at::Tensor qk = qkv.slice(1, 0, q_size + kv_size).view({b, -1, head_dim});
      call1(rotary_op(), {qk, cos, sin});
      q = qk.slice(1, 0, heads);
      k = qk.slice(1, heads);
    }
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    // slots and block tables of the layer's KV-cache group (engine/kv/groups.py; one group: the same for all)
    call1(store_op(), {k, v, k_cache, v_cache, slot_mappings[l], block_size});
    const at::Tensor attn =
        call1(attention_op(), {q, k_cache, v_cache, tables[l], lens, block_size, max_context, scale, windows[l],
                               softcap});  // [B, H, D]; windows[l]: the layer's sliding window (0: none)
    const at::Tensor attn2d = attn.reshape({b, -1});
    h = linear(attn2d, weights, l, O_W, kind[1], nk[2], nk[3], gt[1]);
    lora.add(h, attn2d, l, 1);
    if (gemma) {  // gemma.py Gemma2DecoderLayer.forward: the norms after attention and around the MLP
      h = gemma_norm(h, get(weights, l, POST_NORM), eps);
      auto [h2, stream2] = add_norm(h, residual, get(weights, l, PRE_FF_NORM), eps, false, true);
      residual = stream2;
      const at::Tensor gu = linear(h2, weights, l, GU_W, kind[2], nk[4], nk[5], gt[2]);
      lora.add(gu, h2, l, 2);
      const at::Tensor act = gelu_tanh_mul(gu);
      at::Tensor down = linear(act, weights, l, DOWN_W, kind[3], nk[6], nk[7], gt[3]);
      lora.add(down, act, l, 3);
      x = gemma_norm(down, get(weights, l, POST_FF_NORM), eps);
      continue;
    }
    // MLP (layers.py GatedMLP.forward) after the post-attention norm.
    auto [h2, stream2] = add_norm(h, residual, get(weights, l, POST_NORM), eps, fused_norm);
    residual = stream2;
    at::Tensor act;
    if (kind[2] == GEMV_SILU) {  // (never with LoRA: fused_decode.py declines such a step)
      act = linear(h2, weights, l, GU_W, kind[2], nk[4], nk[5], gt[2]);
    } else {
      const at::Tensor gu = linear(h2, weights, l, GU_W, kind[2], nk[4], nk[5], gt[2]);
      act = lora.add_silu(gu, h2, l);
      if (!act.defined()) {
        lora.add(gu, h2, l, 2);
        act = silu_mul(gu);
      }
    }
    x = linear(act, weights, l, DOWN_W, kind[3], nk[6], nk[7], gt[3]);
    lora.add(x, act, l, 3);
  }
  return {x, residual};
}

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.class_<LoraSet>("LoraSet")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, int64_t>());
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] k_caches, Tensor[] v_caches, "
        "Tensor[] slot_mappings, Tensor[] block_tables, Tensor context_lens, int block_size, int max_context, float scale, Tensor?[] weights, "
        "int[] kinds, int[] shapes, int heads, int kv_heads, int head_dim, float eps, bool fused_norm, "
        "bool qk_norm, __torch__.torch.classes.tokenmill.LoraSet? lora, Tensor? lora_slots, int[] windows, int[] ggml_types, bool gemma, float softcap, Tensor? cos_local, Tensor? sin_local, "
        "int[] local_rope) -> Tensor[]");
  m.impl("decode_layers", c10::DispatchKey::CPU, TORCH_FN(decode_layers));
  // oneDNN-packed weights among the arguments make the dispatcher pick MkldnnCPU: the same function.
  m.impl("decode_layers", c10::DispatchKey::MkldnnCPU, TORCH_FN(decode_layers));
}
