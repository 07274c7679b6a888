"""Model: the pass's data, and the transformers fallback's forward.

`pack` lays a plan's chunks out as one sequence with `position_ids` restarting per question and
`cu_seqlens` (`PackedBatch`, plain data every backend reads); `kv_pool` is the paged KV memory,
budgeted; `setup` makes a transformers model packable (and refuses what cannot be packed) and
gives it back on `close()`; `forward` runs a transformers model on a pack; `attention` registers
Kev's attention in transformers' `AttentionInterface`, handing every layer to the attention
backend the pass names; `rotary` names the rotary embeddings and refuses the rope types a pack
cannot share. Loading a model (`kev_engine.loader`) and running a plan (`kev_engine.runner`)
compose this with `models` and `platforms`, above them.
"""
