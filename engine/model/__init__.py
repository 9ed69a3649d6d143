"""Model execution: loading, packing, the paged KV tensor and attention, the model runner."""
