"""Device backends of the engine's attention: which kernel reads the KV pool, chosen once per engine.

`cuda` — the paged kernels on a GPU (torch's own `varlen_attn`, or the optional flash-attn);
`cuda_graphs` — decode passes replayed as CUDA graphs, one per row-count bucket;
`cuda_invariant` with `cuda_triton` — batch invariance on a GPU (fixed-order products and norms).
The CPU paths live in `attention` and `kernels` (another issue moves them behind this seam).
"""
