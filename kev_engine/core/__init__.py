"""Core: the requests' lives and the passes they share.

`request` holds a request's state (WAITING → RUNNING → FINISHED); `schedule` is its owner: it
queues, admits (KV blocks and the adapter's slot), preempts, forks `n > 1` samples (`fanout`),
frees, and decides what runs each pass within a time budget (`pass_cost`) and a token cap, fair
to short questions behind long prompts, as a `plan` (its chunks; the pass being planned and what
is left of its budgets); `slice_work` paces a paused pass's slices; `blocks` keeps KV block
tables, refcounts and the prefix cache; `drafts` proposes speculative tokens; `arrivals` decides
when an idle engine's first pass starts; `worker` is the one thread that runs steps; `delivery`
the threads that run callers' callbacks, in order per request; `latency` keeps the histograms
`stats()` shows. Nothing here touches the model.
"""
