"""LoRA adapters served beside their base model (an optional component: engine.capabilities
reaches it)."""
