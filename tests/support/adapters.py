"""LoRA adapters for the tests, made with peft."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model


def save_adapter(
    model: torch.nn.Module, folder: Path, rank: int, targets: list, seed: int, scale: float = 0.05
) -> Path:
    """A random-weight adapter from peft (B not zero, as trained ones are not), B scaled
    by `scale`: at full size a random B drowns a real model's own output."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(scale)
    peft_model.save_pretrained(folder)
    peft_model.unload()  # the base model's modules back, without the adapter
    return folder
