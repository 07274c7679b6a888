"""Model: a pass's chunks → one flat pack → the transformers model → logits.

`loader` reads a model (safetensors, GGUF, hub id) and `setup` makes it packable and gives it
back on `close()`; `pack` lays chunks out as one sequence with `position_ids` restarting per
question and `cu_seqlens`; `runner` runs the model on a pack with each segment's adapter routed;
`forward` is the call itself; `attention` registers Kev's attention in transformers'
`AttentionInterface`, handing every layer to the platform's attention backend; `kv_pool` is the
paged KV memory, budgeted; `rotary` names the rotary embeddings and refuses the rope types a pack
cannot share.
"""
