"""LoRA adapters made by PEFT itself on the seeded tiny models, and PEFT's greedy output as reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class AdapterSpec:
    """What PEFT is asked to make: rank, alpha, rsLoRA, target modules, seed of its random A and B."""

    r: int
    alpha: int
    targets: tuple[str, ...]
    rslora: bool = False
    seed: int = 0


# Three different adapters: every projection; attention only with rsLoRA; o + MLP with a higher rank.
SPECS = {
    "all": AdapterSpec(8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=1),
    "attn": AdapterSpec(4, 8, ("q_proj", "v_proj"), rslora=True, seed=2),
    "mlp": AdapterSpec(16, 32, ("o_proj", "gate_proj", "down_proj"), seed=3),
}


def make_adapter(base: Path, out: Path, spec: AdapterSpec) -> Path:
    """A PEFT LoRA folder for the model at `base`, with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets), use_rslora=spec.rslora,
                     lora_dropout=0.1, init_lora_weights=False)  # fmt: skip
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():  # init_lora_weights=False draws B like A; scale it so outputs change but stay sane
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    peft_model.save_pretrained(str(out))
    return out


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers (+ PEFT when `adapter` is given) generate(do_sample=False), float32, prompt by prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)  # fmt: skip
            out.append(seq[0, len(prompt):].tolist())
    return out


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]
