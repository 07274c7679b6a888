"""The CUDA platform: paged varlen attention, decode CUDA graphs, batch invariance by Triton.

`varlen` is the attention backend (torch's `varlen_attn`, or flash-attn's, over the paged pool);
`graphs` replays decode passes as CUDA graphs, one per row-count bucket; `invariant` with
`triton_kernels` computes Linear products and RMSNorms in one fixed order per output.
"""
