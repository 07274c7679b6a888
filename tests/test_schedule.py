"""The scheduler and the block manager on their own: no model, just requests, tokens and blocks."""

from __future__ import annotations

from kev_engine.core.blocks import BlockManager, BlockTable
from kev_engine.core.plan import Chunk
from kev_engine.core.request import Request, Status
from kev_engine.core.schedule import Scheduler
from kev_engine.inputs.params import SamplingParams


def request(i: int, prompt: list[int], max_tokens: int = 8, prefix_key: object = None) -> Request:
    return Request(request_id=i, prompt_ids=prompt, sampling=SamplingParams(temperature=0, max_tokens=max_tokens),
                   settings_version=0, max_total=len(prompt) + max_tokens, prefix_key=prefix_key)


def test_full_blocks_are_shared_by_exact_key_and_the_last_token_always_runs() -> None:
    blocks = BlockManager(num_blocks=16, block_size=4)
    doc = list(range(100, 112))  # 3 full blocks
    a, b, c, d = BlockTable(), BlockTable(), BlockTable(), BlockTable()
    assert blocks.allocate(a, doc + [1, 2], extra=None) == 0
    blocks.commit(a, doc + [1, 2], None, num_computed=14)  # computed: its 3 full blocks become findable
    assert blocks.allocate(b, doc + [3], extra=None) == 12 and b.block_ids[:3] == a.block_ids[:3]
    assert blocks.allocate(c, doc + [3], extra=("adapter", 1)) == 0  # another adapter: no sharing
    assert blocks.allocate(d, doc, extra=None) == 8  # a fully cached prompt still computes its last block
    assert blocks.blocks[a.block_ids[0]].ref_count == 3


def test_within_a_pass_a_later_chunk_finds_blocks_an_earlier_chunk_writes() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    a, b = BlockTable(), BlockTable()
    blocks.allocate(a, list(range(9)), None)
    blocks.announce(a, list(range(9)), None, computed_after=4)  # this pass writes only a's first block
    assert blocks.allocate(b, list(range(9)), None) == 4
    blocks.end_pass()
    c = BlockTable()
    assert blocks.allocate(c, list(range(9)), None) == 0  # announced, never committed: not findable now


def test_unused_keyed_blocks_stay_cached_until_their_memory_is_needed() -> None:
    blocks = BlockManager(num_blocks=4, block_size=2)
    a = BlockTable()
    blocks.allocate(a, [1, 2, 3, 4, 5], None)
    blocks.commit(a, [1, 2, 3, 4, 5], None, num_computed=5)
    blocks.free(a)
    assert blocks.num_used == 0 and len(blocks.cached) == 2 and blocks.num_available == 4
    b = BlockTable()
    assert blocks.allocate(b, [1, 2, 3, 4, 9], None) == 4  # reused from the cache
    other = BlockTable()
    assert blocks.allocate(other, [7, 7, 7], None) is None  # 2 needed, 1 free: nothing taken
    assert blocks.grow(other, 2) and blocks.evictions == 0  # the one free block, no eviction
    blocks.free(b)
    assert blocks.grow(other, 6) and blocks.evictions == 1  # b's free block, then one cached block forgotten


def ran(scheduler: Scheduler, chunks: list[Chunk], token: int = 0) -> None:
    """A pass ran `chunks`, and each drew `token` (the engine's records do that part)."""
    scheduler.update(chunks)
    for chunk in chunks:
        chunk.request.output_ids.append(token)


def test_schedule_admits_by_memory_and_preempts_the_newest() -> None:
    blocks = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(max_batch_tokens=64, max_num_seqs=8, blocks=blocks)
    first, second = request(0, [1, 2, 3, 4, 5, 6]), request(1, [7, 8, 9, 10, 11, 12])
    scheduler.add([first, second])
    chunks = scheduler.schedule()
    assert [c.request for c in chunks] == [first, second] and blocks.num_used == 4  # 2 blocks each
    ran(scheduler, chunks)
    for _ in range(2):  # decode up to 8 tokens: both fit in their 2 blocks
        chunks = scheduler.schedule()
        ran(scheduler, chunks)
    chunks = scheduler.schedule()  # token 9 needs a third block each: the newest is preempted
    assert [c.request for c in chunks] == [first] and second.status is Status.WAITING
    assert second.num_computed == 0 and scheduler.waiting[0] is second and scheduler.preemptions == 1


def test_token_budget_chunks_a_long_prompt_and_running_requests_go_first() -> None:
    blocks = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(max_batch_tokens=10, max_num_seqs=4, blocks=blocks)
    long_one, short = request(0, list(range(25))), request(1, [1, 2, 3])
    scheduler.add([long_one])
    first = scheduler.schedule()
    assert [(c.request, c.num_tokens) for c in first] == [(long_one, 10)]
    scheduler.update(first)  # its first 10 tokens are computed
    scheduler.add([short])
    chunks = scheduler.schedule()
    assert [(c.request, c.num_tokens) for c in chunks] == [(long_one, 10)]  # the budget is spent on it first
