"""The linear layers that replace `nn.Linear` for speed: packed for oneDNN, the bf16
kernel, int8/int4 group quantization (an optional component: the core reaches it only through
`engine.capabilities`)."""
