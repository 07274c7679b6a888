"""Core: the requests' lives and the passes they share.

`request` holds a request's state (WAITING → RUNNING → FINISHED); `schedule` decides what runs
each pass within a time budget (`pass_cost`) and a token cap, fair to short questions behind long
prompts; `blocks` owns KV block tables, refcounts and the prefix cache; `lifecycle` queues,
admits, records and frees; `fanout` forks `n > 1`; `arrivals` decides when an idle engine's first
pass starts; `worker` is the one thread that runs steps; `threads` carries a caller's thread
state onto it; `latency` keeps the histograms `stats()` shows. Nothing here touches the model.
"""
