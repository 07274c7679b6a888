"""Sample: logits at segment ends → one token per row, each row with its own settings.

`sample` draws (temperature, min-p, top-k, top-p, seed as per-row tensors), `penalties` applies
each row's repetition, presence and frequency penalties and logit bias, `grammar` masks a row to
what its constraint allows (xgrammar), `logprobs` reports chosen and top tokens. Sampling reads
and writes no KV memory.
"""
