"""The endpoints that run the server rather than a model: health, version and metrics,
sleep and wake, and loading or unloading LoRA adapters."""
