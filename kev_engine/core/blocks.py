"""Block manager: which question owns which KV blocks, and which full blocks are shared.

Where this sits: `schedule` asks it whether a request's KV fits before admitting it (and for one
more block as a decode grows); `Engine` frees everything a request holds in one call.

Prefix sharing (vLLM's automatic prefix caching, with exact keys instead of hashes): a FULL block
is keyed by (its parent's key id, its token ids); the first block's parent is the request's
`extra` key — adapter name and loaded version, and the `cache_salt` — so different adapters or
tenants never share a block. Keys are compared by value (no hash collision can alias two
prefixes). A block is findable only once its KV is computed, or — within one pass — once an
earlier chunk of the same pass is going to write it (`attention` writes every segment's keys
before any segment reads, layer by layer). Blocks in use are refcounted and never evicted;
a block nobody uses but whose key is known stays cached (LRU) until its memory is needed.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

ExtraKey = Hashable
MIN_RUN = 8  # free blocks are handed out from runs of at least this many consecutive ids first


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens (the last one may be partly filled)."""
    return -(-num_tokens // block_size)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: tuple | None = None  # set while the block is findable by its prefix
    node: int = -1  # id children key themselves under


@dataclass
class BlockTable:
    """One request's blocks, in position order, and how far its prefix chain is keyed."""

    block_ids: list[int] = field(default_factory=list)
    num_keyed: int = 0  # leading full blocks whose key is known (matched, or registered after compute)
    parent_node: int | None = None  # node of block num_keyed - 1 (None: chain starts at the extra key)
    cacheable: bool = True

    def __len__(self) -> int:
        return len(self.block_ids)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids = list(range(num_blocks))  # sorted: see _take for the order they are handed out
        self.cached: OrderedDict[int, None] = OrderedDict()  # unused but findable, oldest first
        self.table: dict[tuple, int] = {}  # prefix key → block id (KV computed)
        self.filling: dict[tuple, int] = {}  # prefix key → block id written by this pass
        self._nodes = itertools.count(1)
        self.evictions = 0  # cached blocks forgotten to make room
        self.fresh: list[int] = []  # blocks handed out since the last take_fresh(): their memory is stale

    # ---- accounting -------------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Blocks a request could get now: free ones plus cached ones nobody uses."""
        return len(self.free_ids) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # ---- allocation -------------------------------------------------------------------------

    def _take(self, count: int) -> list[int]:
        """`count` blocks nobody uses (the caller checked there are enough).

        Free blocks come first, from the lowest runs of at least MIN_RUN consecutive ids: the
        torch decode path reads a pass's blocks as a few dense ranges of the pool, and lone free
        blocks — a finished request's tail between its cached prefix blocks — would scatter them
        over the pool (each then gathered, or a range read with holes). Lone free blocks go next,
        lowest first; then the least recently used cached blocks, forgotten.
        """
        picked = sorted(_runs_first(self.free_ids, count))
        taken = [self.free_ids[k] for k in picked]
        end = len(picked)
        while end > 0:  # delete contiguous index spans, last first (a run is one slice)
            start = end - 1
            while start > 0 and picked[start - 1] == picked[start] - 1:
                start -= 1
            del self.free_ids[picked[start] : picked[end - 1] + 1]
            end = start
        while len(taken) < count:
            block_id, _ = self.cached.popitem(last=False)
            self.evictions += 1
            block = self.blocks[block_id]
            assert block.key is not None and block.ref_count == 0
            self.table.pop(block.key, None)
            block.key, block.node = None, -1
            taken.append(block_id)
        for block_id in taken:
            self.blocks[block_id].ref_count = 1
        self.fresh.extend(taken)
        return taken

    def take_fresh(self) -> list[int]:
        """Blocks handed out since the last call. Backends whose kernel reads whole blocks (and
        masks the slots past a row's length) clear them first (`AttentionBackend.new_blocks`):
        0 x NaN from stale memory is NaN."""
        fresh, self.fresh = self.fresh, []
        return fresh

    def _key(self, parent: int | None, extra: ExtraKey, tokens: Sequence[int]) -> tuple:
        return (parent, tuple(tokens)) if parent is not None else ("root", extra, tuple(tokens))

    def match(self, token_ids: Sequence[int], extra: ExtraKey) -> list[int]:
        """Leading full blocks of `token_ids` already computed (or being computed this pass).

        The last token is never matched: a question whose whole prompt is cached still runs its
        last token, for the logits it samples from.
        """
        hits: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            key = self._key(parent, extra, token_ids[start : start + bs])
            block_id = self.table.get(key, self.filling.get(key))
            if block_id is None:
                break
            hits.append(block_id)
            parent = self.blocks[block_id].node
        return hits

    def allocate(self, table: BlockTable, token_ids: Sequence[int], extra: ExtraKey, watermark: int = 0) -> int | None:
        """Give a new request blocks for `token_ids`, sharing what is cached. Returns the number of
        prompt tokens whose KV is reused, or None (nothing taken) when the rest does not fit."""
        hits = self.match(token_ids, extra) if table.cacheable else []
        new = self.blocks_for(len(token_ids)) - len(hits)
        reclaimable = self.num_available - sum(1 for b in hits if b in self.cached)
        if new + watermark > reclaimable:
            return None
        for block_id in hits:
            block = self.blocks[block_id]
            block.ref_count += 1
            self.cached.pop(block_id, None)
        table.block_ids = hits + self._take(new)
        table.num_keyed = len(hits)
        table.parent_node = self.blocks[hits[-1]].node if hits else None
        return len(hits) * self.block_size

    def grow(self, table: BlockTable, num_tokens: int, watermark: int = 0) -> bool:
        """Make room for a request to reach `num_tokens` tokens; False (nothing taken) if that would
        leave fewer than `watermark` blocks available."""
        need = self.blocks_for(num_tokens) - len(table.block_ids)
        if need > 0 and need + watermark > self.num_available:
            return False
        table.block_ids.extend(self._take(need))
        return True

    def shrink(self, table: BlockTable, num_tokens: int) -> None:
        """Free the request's blocks wholly past its first `num_tokens` tokens (rows of a draft its
        answer did not take): they hold nothing keyed and nobody else's."""
        keep = self.blocks_for(num_tokens)
        while len(table.block_ids) > max(keep, table.num_keyed):
            block = self.blocks[table.block_ids.pop()]
            assert block.ref_count == 1 and block.key is None, f"block {block.block_id} is shared or keyed"
            block.ref_count, block.node = 0, -1
            bisect.insort(self.free_ids, block.block_id)

    def fork(self, source: BlockTable, target: BlockTable, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give `target` the KV of `source`'s first `num_tokens` tokens without computing it: the
        full blocks are shared (refcounted; read-only, since later positions go to later blocks),
        and a partly filled last block — which both requests go on writing — becomes a block of
        `target`'s own. Returns the (source block, its copy) pairs whose KV the caller must copy,
        or None (`target` untouched) when no block is free for the copy.

        The copy is not listed as fresh (`take_fresh`): zeroing it before the next pass would wipe
        the KV copied into it."""
        full, partial = divmod(num_tokens, self.block_size)
        if partial and not self.num_available:
            return None
        shared = source.block_ids[:full]
        for block_id in shared:
            self.blocks[block_id].ref_count += 1
        copies: list[tuple[int, int]] = []
        if partial:
            copy = self._take(1)[0]
            self.fresh.remove(copy)
            copies.append((source.block_ids[full], copy))
        target.block_ids = shared + [c for _, c in copies]
        # the prefix chain keyed so far is the source's (only shared blocks can be in it); the rest
        # of target's full blocks are keyed when it commits, finding the source's keys
        assert source.num_keyed <= full, "a fork's source has keyed blocks past the tokens it shares"
        target.num_keyed, target.parent_node = source.num_keyed, source.parent_node
        return copies

    def announce(self, table: BlockTable, token_ids: Sequence[int], extra: ExtraKey, computed_after: int) -> None:
        """This pass will compute the request's tokens up to `computed_after`: make its full blocks
        findable by later chunks of the same pass."""
        self._key_blocks(table, token_ids, extra, computed_after, self.filling)

    def commit(self, table: BlockTable, token_ids: Sequence[int], extra: ExtraKey, num_computed: int) -> None:
        """After a pass: full blocks whose KV is now computed become findable by later requests."""
        self._key_blocks(table, token_ids, extra, num_computed, self.table)

    def end_pass(self) -> None:
        self.filling.clear()

    def swap_filling(self, filling: dict) -> dict:
        """Put `filling` in place of the blocks the current pass is computing and return those: a
        pass paused between its layers has computed only some layers of them, so a pass run
        meanwhile must not start after them (`Stepper`); the paused pass takes them back."""
        previous, self.filling = self.filling, filling
        return previous

    def _key_blocks(self, table: BlockTable, token_ids: Sequence[int], extra: ExtraKey, upto: int, into: dict) -> None:
        if not table.cacheable:
            return
        bs = self.block_size
        index, parent = table.num_keyed, table.parent_node
        while (index + 1) * bs <= upto and index < len(table.block_ids):
            key = self._key(parent, extra, token_ids[index * bs : (index + 1) * bs])
            block = self.blocks[table.block_ids[index]]
            known = self.table.get(key)
            if known is not None and known != block.block_id:
                parent = self.blocks[known].node  # the same content is cached elsewhere: chain through it
            else:
                if block.node < 0:
                    block.node = next(self._nodes)
                if into is self.filling:
                    into.setdefault(key, block.block_id)
                else:
                    block.key = key
                    self.table[key] = block.block_id
                parent = block.node
            index += 1
        if into is self.table:  # filling is provisional: the chain position advances only when computed
            table.num_keyed, table.parent_node = index, parent

    def free(self, table: BlockTable) -> None:
        """Give back every block the request holds; keyed ones stay cached for the next request."""
        for block_id in reversed(table.block_ids):  # the tail first: it is evicted first
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.key is not None:
                    self.cached[block_id] = None
                else:
                    block.node = -1
                    bisect.insort(self.free_ids, block_id)
        table.block_ids = []
        table.num_keyed, table.parent_node = 0, None


def _runs_first(free_ids: list[int], count: int) -> list[int]:
    """Indices into sorted `free_ids` of the `count` blocks to hand out: those in runs of at least
    MIN_RUN consecutive ids, lowest first, then the lowest of the rest."""
    picked: list[int] = []
    start, total = 0, len(free_ids)
    while start < total and len(picked) < count:
        end = _run_end(free_ids, start)
        if end - start >= MIN_RUN:
            picked.extend(range(start, min(end, start + count - len(picked))))
        start = end
    if len(picked) < count:
        chosen = set(picked)
        picked.extend(itertools.islice((k for k in range(total) if k not in chosen), count - len(picked)))
    return picked


def _run_end(ids: list[int], start: int) -> int:
    """End (exclusive) of the run of consecutive ids at `start`. The ids are sorted and distinct,
    so ids[k] - k never decreases and stays constant exactly along a run: bisection, not a scan
    (a fresh pool is one run of every block)."""
    key, low, high = ids[start] - start, start + 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        if ids[mid] - mid == key:
            low = mid + 1
        else:
            high = mid
    return low
