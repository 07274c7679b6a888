"""One tiny pack through a CUDA attention backend before an engine trusts it.

Where this sits: `choice.choose`, once per engine on a GPU, after a kernel's signature looked
right. The kernels' contracts (causal alignment, grouped heads, what `max_q` and the tables mean)
come from their sources and docs, which move between torch releases; a kernel that takes the
parameters but computes something else would give every answer wrong without an error. So the
backend runs once, through its own `plan` and `attend`, on a pack whose every part a wrong
contract would show: a prefill, a decode row after a cached prefix, a chunk continuing a prefix
that crosses a block boundary (bottom-right causal alignment), grouped query heads, blocks
scattered through the pool — against attention computed per segment in float32.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ...core.blocks import blocks_for
from ...model.pack import Segment

if TYPE_CHECKING:
    from .varlen import VarlenBackend

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
TOLERANCE = 2e-2  # float16/bfloat16 rounding of outputs of magnitude about 1


def probe_segments(block_size: int) -> list[tuple[int, int]]:
    """(cached tokens, new tokens) of each probe segment."""
    return [(0, 3), (5, 1), (block_size + 2, 4)]


def contract_error(backend: VarlenBackend, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `backend` does not compute causal attention per segment on `device` in `dtype`, or None.

    The backend is bound to a probe pool for the call; `allocate` binds it to the engine's own later."""
    block_size = max(backend.default_block_size, backend.block_multiple)
    shapes = probe_segments(block_size)
    generator = torch.Generator().manual_seed(0)
    num_blocks = sum(blocks_for(past + new, block_size) for past, new in shapes) + 1
    order = torch.randperm(num_blocks, generator=generator).tolist()  # blocks scattered through the pool
    layout = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    keys = torch.randn(layout, generator=generator).to(dtype)
    values = torch.randn(layout, generator=generator).to(dtype)
    segments, cursor = [], 0
    for i, (past, new) in enumerate(shapes):
        count = blocks_for(past + new, block_size)
        segments.append(Segment(i, [0] * new, past, needs_logits=False, block_ids=order[cursor: cursor + count]))
        cursor += count
    news = [new for _, new in shapes]
    cu_q = [0]
    for new in news:
        cu_q.append(cu_q[-1] + new)
    query = torch.randn(HEADS, cu_q[-1], HEAD_DIM, generator=generator).to(dtype)
    pool = SimpleNamespace(keys=[keys.to(device)], values=[values.to(device)], block_size=block_size)
    backend.bind(pool)
    try:
        batch = SimpleNamespace(cu_seqlens=torch.tensor(cu_q, dtype=torch.int32, device=device),
                                cu_seqlens_list=cu_q, max_seqlen=max(news),
                                attention=backend.plan(segments, cu_q, device))
        out = backend.attend(0, batch, query.to(device), None, None, None).float().cpu()  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - whatever the kernel raises is the reason it cannot serve
        return f"it failed on a probe pack ({type(exc).__name__}: {str(exc)[:300]})"
    finally:
        backend.pool = None
    expected = per_segment(query.float(), keys.float(), values.float(), segments, cu_q)
    if out.shape != expected.shape:
        return f"it returned {tuple(out.shape)} for a probe pack, not {tuple(expected.shape)}"
    worst = (out - expected).abs().nan_to_num(nan=float("inf")).amax(dim=(1, 2))
    wrong = [i for i, (start, stop) in enumerate(zip(cu_q, cu_q[1:])) if float(worst[start:stop].max()) > TOLERANCE]
    if wrong:
        shown = ", ".join(f"{shapes[i][1]} new after {shapes[i][0]} cached" for i in wrong)
        return (f"on a probe pack it differs from causal attention per segment (bottom-right aligned, "
                f"{HEADS} query heads over {KV_HEADS} key heads) by up to {float(worst.max()):.3g} "
                f"in these segments: {shown}")
    return None


def per_segment(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, segments: list[Segment],
                cu_q: list[int]) -> torch.Tensor:
    """[T, H, D]: each segment's new queries over its own keys, causal from its last position back."""
    out = torch.empty(query.shape[1], HEADS, HEAD_DIM)
    for seg, start, stop in zip(segments, cu_q, cu_q[1:]):
        n, m = stop - start, seg.end
        k = keys[seg.block_ids].flatten(0, 1)[:m].transpose(0, 1)  # [kvH, m, D]
        v = values[seg.block_ids].flatten(0, 1)[:m].transpose(0, 1)
        mask = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n)
        o = F.scaled_dot_product_attention(query[None, :, start:stop], k[None], v[None], attn_mask=mask,
                                           enable_gqa=True)
        out[start:stop] = o[0].transpose(0, 1)
    return out
