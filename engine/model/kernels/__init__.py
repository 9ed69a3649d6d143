"""Native kernels: C++ for the CPU (built on first use) and Triton for CUDA. The attention
kernels are optional components, reached only through `engine.model.attention_backend`."""
