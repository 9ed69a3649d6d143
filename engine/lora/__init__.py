"""LoRA adapters served beside their base model (room: engine.capabilities reaches it)."""
