"""SmolLM3: Llama with no RoPE on some layers (NoPE). config.no_rope_layers holds one flag per layer,
transformers' convention: 1 means the layer uses rotary, 0 that it does not (by default every 4th
layer, no_rope_layer_interval, is a NoPE layer)."""

from __future__ import annotations

from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class SmolLM3Attention(LlamaAttention):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        flags = cfg.no_rope_layers
        if len(flags) != cfg.num_hidden_layers:
            raise ValueError(f"no_rope_layers has {len(flags)} entries for {cfg.num_hidden_layers} layers")
        self.use_rope = bool(flags[layer_idx])


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    attention_cls = SmolLM3Attention


class SmolLM3ForCausalLM(LlamaForCausalLM):
    layer_cls = SmolLM3DecoderLayer

    def fused_decode_unsupported(self) -> str | None:
        if all(layer.self_attn.use_rope for layer in self.model.layers):
            return super().fused_decode_unsupported()
        return "layers without RoPE (no_rope_layers)"
