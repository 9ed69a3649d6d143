"""Compiled and captured step paths: the Inductor-compiled forward (CPU) and the CUDA
decode graphs (an optional component: the core reaches it only through `engine.capabilities`)."""
