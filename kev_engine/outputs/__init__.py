"""Outputs: drawn tokens → text, stops, finishes, and each caller's result.

`processor` is the stage (`OutputProcessor`: a pass's draws onto their requests, text streamed,
results delivered), `unpack` turns tokens into text deltas and applies stop strings,
`detokenize` decodes a reply token by token. What callers get back (`Completion`, `TextPiece`)
is in `kev_engine.results`; the threads that hand it over are `core.delivery`'s.
"""
