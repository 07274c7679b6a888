"""Adapters: LoRA adapters per segment of one packed pass.

`peft_files` reads and validates a PEFT adapter folder (refusing what the packed path cannot
compute exactly like PEFT); `lora` holds the runtime layers — `MultiLoRALinear` runs the base
projection once over the pack and each adapter's delta only on its own rows; `pool` keeps
`max_adapters` resident on the model's device and evicts the least recently used idle one.
"""
