"""A Llama-style model's pass as Kev's calls alone: the embedding, the rotary table, each decoder
layer's one kernel call (`kernels.DecoderLayer`), the final norm and the output head.

Where this sits: the CPU platform offers it on the batch-invariant path (`CpuPlatform.model_forward`)
and the runner takes it for a pass it fits (`ModelRunner.forward`), else the model's own forward.

Why: a decode step of few rows is thirty layer calls, and around each the model's forward adds
`nn.Module.__call__`, transformers' keyword arguments and output wrappers, and the layer's own
checks; with the forward of the model around them that is about a tenth of a one-row step of a
small model. Here the same functions run on the same tensors in the same order — the modules'
forwards Kev installed for the embedding, rotary table, norm and head, and each layer's
`DecoderLayer` — so a pass gives bitwise what the model's forward gives. That is checked, not
assumed: the first pass it fits of decode rows alone, at most `CHECK_ROWS` of them, runs both
ways, and where they differ (a transformers release whose model forward computes something else)
it is never used again and a warning says so. A decode pass, because running it twice costs
little, and the pass budget's cost model, which times every pass, soon forgets it: its fit reads
the last 32 passes, and of older ones only those with about 32 tokens' products or more
(`core/pass_cost.py`), which a pass of a few decode rows has not.

Which passes it fits: the model an instance of one of the listed classes, every decoder layer on
its one-call forward with its parts as installed and unhooked (`layer_forward.native_ready`), no
hooks on the model, its base model or a layer, none for every module (a call through them would
run them), the pool Kev's exact one. What it found is watched (`watch.Watch`), not looked up
again each pass.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from ...model.forward import run_model
from ...model.pack import PackedBatch
from ..inplace import modeling_class
from ..watch import Watch
from . import layer_forward
from .exact import ExactBackend

log = logging.getLogger("kev")

CLASSES = ("llama.LlamaForCausalLM", "mistral.MistralForCausalLM", "qwen2.Qwen2ForCausalLM",
           "qwen3.Qwen3ForCausalLM")
CHECK_ROWS = 16  # the pass that checks runs twice: the first of decode rows alone, at most this many


@functools.cache
def _listed() -> frozenset[type]:
    return frozenset(found[0] for name in CLASSES if (found := modeling_class(name)) is not None)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


class ModelForward:
    """The pass of one model as Kev's calls; `fits` says when it may run instead of the model."""

    def __init__(self, model: nn.Module, backend: ExactBackend) -> None:
        self.model = model
        self.backend = backend
        self.checked: bool | None = None  # None: not yet compared with the model's forward
        self._fitted: list[Any] | None = None  # the layers' parts `fits` found, for `run` next
        self._found: list[Any] = []  # the layers' parts last found ([]: none fit)
        self._watch: Watch | None = None  # what they rest on, while they fit

    def fits(self, batch: PackedBatch) -> bool:
        """Whether `run` may take this pass; the runner calls `run` next, under its lock."""
        self._fitted = None
        if self.checked is False or batch.slot_blocks is None:
            return False
        self._fitted = self._layers()
        return self._fitted is not None and (
            self.checked is True or batch.num_tokens == len(batch.request_ids) <= CHECK_ROWS)

    def run(self, batch: PackedBatch) -> torch.Tensor:
        """fp32 logits at `batch.logits_indices` ([K, vocab]), as `run_model` returns them."""
        logits = self._run(batch)
        if logits is None:
            return run_model(self.model, batch, self.backend)
        if self.checked is None:  # the pool's writes are the same values to the same slots: idempotent
            own = run_model(self.model, batch, self.backend)
            self.checked = torch.equal(logits, own)
            if not self.checked:
                log.warning("Kev: %s's forward no longer computes what Kev's direct pass does: passes run the "
                            "model's own forward", type(self.model).__qualname__)
            return own
        return logits

    def _layers(self) -> list[Any] | None:
        """Each decoder layer's installed parts (`layer_forward._Parts`), every one ready for its
        one call, or None where a pass must go through the model. Once found, a pass only asks
        whether anything they rest on has changed (`Watch`), and finds them again if so."""
        if (self._watch is not None and type(self.model) in _listed() and self._watch.holds()
                and layer_forward.attention_is_kev(self._found)):
            return self._found
        self._found, self._watch = self._find()
        return self._found or None

    def _find(self) -> tuple[list[Any], Watch | None]:
        """The layers' parts, looked up ([] where a pass must go through the model), and a watch
        over what was read, each object as it was read (another thread may change the model
        meanwhile: the next pass then sees it): the base model and its layer list where they
        were, neither hooked nor given a forward, the list neither longer nor shorter, each layer
        on its one-call forward, unhooked, its parts (`_Parts.watch`) and norms' weights held."""
        model: Any = self.model
        watch = Watch().no_global_hooks()
        inner: Any = watch.table(model, "_modules").get("model")
        if (type(model) not in _listed() or not isinstance(inner, nn.Module) or _hooked(model) or _hooked(inner)
                or torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks):
            return [], None
        layers: Any = watch.table(inner, "_modules").get("layers")
        if not isinstance(layers, nn.ModuleList):
            return [], None
        watch.entry(model._modules, "model", inner).entry(inner._modules, "layers", layers)
        for module in (model, inner):
            watch.unhooked(module).entry(module.__dict__, "forward", None)
        entries = tuple(watch.table(layers, "_modules").items())  # one read: a list edited meanwhile is seen next pass
        watch.entry(layers._modules, str(len(entries)), None)  # nothing appended
        found = []
        for key, layer in entries:
            forward = layer.__dict__.get("forward")
            if (not isinstance(forward, functools.partial) or forward.func is not layer_forward._forward
                    or layer._forward_hooks or layer._forward_pre_hooks):
                return [], None
            parts = forward.args[1]
            watch.entry(layers._modules, key, layer).entry(layer.__dict__, "forward", forward)
            watch.unhooked(layer).extend(parts.watch).extend(parts.native_norms)
            found.append(parts)
        return (found, watch) if layer_forward.native_ready(found) else ([], None)

    @torch.inference_mode()
    def _run(self, batch: PackedBatch) -> torch.Tensor | None:
        """What LlamaModel.forward and the head do on Kev's forwards, or None where the dtypes say
        the layers would not take their one call (the model's forward then runs)."""
        model: Any = self.model
        inner, layers = model.model, self._fitted if self._fitted is not None else self._layers()
        self._fitted = None
        if layers is None:
            return None
        hidden = inner.embed_tokens(batch.input_ids[None])  # [1, T, hidden]
        cos, sin = inner.rotary_emb(hidden, batch.position_ids[None])
        dtype, tokens = hidden.dtype, batch.num_tokens
        if cos.dtype != dtype or sin.dtype != dtype or any(parts.native_dtype != dtype for parts in layers):
            return None
        cos, sin = cos.reshape(tokens, -1).contiguous(), sin.reshape(tokens, -1).contiguous()
        flat = hidden.reshape(tokens, -1)
        for parts in layers:
            flat = layer_forward.run_native(parts, flat, cos, sin, self.backend, batch)
        hidden = inner.norm(flat.view(1, tokens, -1))
        return model.lm_head(hidden[:, batch.logits_indices, :])[0].float()
