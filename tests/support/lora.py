"""Random PEFT LoRA adapters of the small HF test models, built and saved with the `peft` package (both A and B
random: the update matters), and HF transformers + PEFT as the reference that runs them."""
from __future__ import annotations

import os

import numpy as np
import torch


def save_peft_adapter(model_dir: str, out_dir: str, *, r: int, alpha: float, targets: list[str], rslora: bool = False,
                      seed: int = 0, **options) -> str:
    """A random LoRA adapter of the HF model in `model_dir` (rank `r`, lora_alpha `alpha`, on `targets`) saved by
    PEFT to `out_dir` (adapter_config.json + adapter_model.safetensors); `options`: more LoraConfig fields."""
    import peft
    import transformers as tf
    if os.path.exists(os.path.join(out_dir, "adapter_config.json")):
        return out_dir
    base = tf.AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                             init_lora_weights=False, **options)
    peft.get_peft_model(base, config).save_pretrained(out_dir)
    return out_dir


def reference_model(model_dir: str, adapter_dir: str | None, quantize=None):
    """HF's model of `model_dir` (eager attention) with the PEFT adapter of `adapter_dir` applied (None: the base);
    `quantize(model)`: changes the base weights first (e.g. tests/support/quant.fake_quantize_hf)."""
    import peft
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    if quantize is not None:
        quantize(model)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    return model


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `prompt`, one forward per token over the whole sequence (no generate(): a
    PeftModel's and a plain model's generate differ in their arguments)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def last_logits(model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float().numpy()
