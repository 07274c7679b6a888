"""Device backends of the engine's attention: which kernel reads the KV pool, chosen once per engine.

`cuda` — the paged kernels on a GPU (torch's own `varlen_attn`, or the optional flash-attn);
`cuda_graphs` — decode passes replayed as CUDA graphs, one per row-count bucket. The CPU paths
live in `attention` and `kernels` (another issue moves them behind this seam).
"""
