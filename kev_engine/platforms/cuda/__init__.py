"""The CUDA platform: varlen attention, decode CUDA graphs, batch invariance by Triton.

`choice` picks the attention backend from what the installed torch has and tries it on a probe
pack (`probe`): `varlen`, one kernel call over the paged pool (torch 2.12+'s `varlen_attn`, or
flash-attn's), `triton_paged`, Kev's own Triton kernel over the pool in place
(`triton_attention`: every torch with Triton), or `gathered`, which copies each segment's
keys/values out of the pool for torch 2.10/2.11's contiguous `varlen_attn`; `graphs` replays
decode passes as CUDA graphs, one per row-count bucket (paged forms only); `invariant` with
`triton_kernels` computes Linear products and RMSNorms in one fixed order per output.
"""
