"""Outputs: sampled tokens → text, stops, finishes, and delivery to each caller.

`completion` is what a caller gets back (`Completion`, streamed `TextPiece`s), `unpack` turns
tokens into text deltas and applies stop strings, `delivery` hands pieces and results through
each request's own queue on delivery threads, never the scheduler's.
"""
