"""Inputs: what a caller sends becomes a checked `Request`, each on its own.

`params` checks the sampling settings (`SamplingParams`, `Defaults` from `KEV_*`), `tokenize`
turns each prompt alone into token ids with its own chat template, and `intake` checks a request
against the engine's limits (context, KV pool, adapters, constraint) so that a bad one fails
alone, on the caller's thread, before anything is queued.
"""
