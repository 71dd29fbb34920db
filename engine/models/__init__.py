"""Supported architectures, keyed by the `architectures` entry of config.json."""

from __future__ import annotations

from engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.granite import GraniteForCausalLM
from engine.models.granite_hybrid import GraniteMoeHybridForCausalLM
from engine.models.lfm2 import Lfm2ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.olmo2 import Olmo2ForCausalLM
from engine.models.olmoe import OlmoeForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen35 import Qwen35ForCausalLM, Qwen35MoeForCausalLM
from engine.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from engine.models.smollm3 import SmolLM3ForCausalLM

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # Llama with a sliding window on every layer (models/windows.py)
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # mixture of experts (engine/models/moe.py)
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,  # attention sinks, clamped-SwiGLU experts (engine/models/gpt_oss.py)
    # hybrid: short convolutions with a per-sequence state beside attention layers (engine/state/)
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    # Gated DeltaNet (a conv window and a recurrent matrix per sequence) beside gated attention (engine/state/)
    "Qwen3_5ForCausalLM": Qwen35ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen35MoeForCausalLM,  # the same with experts on every layer (engine/models/moe.py)
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,  # Mamba2 + attention (engine/models/mamba2.py)
}


def model_class(architectures: list[str] | None) -> type[LlamaForCausalLM]:
    for arch in architectures or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(
        f"unsupported architecture {architectures!r}; supported: {sorted(ARCHITECTURES)}"
    )
