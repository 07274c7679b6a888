"""A model's rotary embeddings: which modules they are, and the rope types a pack cannot share.

Where this sits: `setup.check_packable` refuses what cannot be packed; the CPU platform's
`rotary_table` serves the same modules from a table. It imports nothing of the engine, so both
sides of the platform seam can use it.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rotary_modules(model: nn.Module) -> list[nn.Module]:
    """The model's rotary-embedding modules (a buffer `inv_freq` and forward(x, position_ids))."""
    return [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]


def check(model: nn.Module) -> None:
    """Refuse rope types whose frequencies depend on the other sequences of a batch: one question's
    length would change the others' positions."""
    for module in rotary_modules(model):
        rope_type = getattr(module, "rope_type", "default")
        if rope_type in BATCH_DEPENDENT_ROPE:
            raise ValueError(
                f"{type(module).__name__} uses rope_type={rope_type!r}, whose frequencies follow the longest "
                "sequence in a batch: packed questions would change each other's positions. Kev packs models "
                f"with static rotary embeddings only (not {', '.join(BATCH_DEPENDENT_ROPE)})"
            )
