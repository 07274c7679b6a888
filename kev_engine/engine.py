"""The engine: requests in, completions out, every pass packed and isolated.

    tokenize → schedule → pack → forward → sample → unpack        (see ../DESIGN.md)

`Engine.step()` is that whole flow once. A scheduler thread runs `step()` while there is
work, so callers of `submit()` on other threads (LangChain's thread pools, LlamaIndex's
`asyncio.gather`) coalesce into the same passes, and waiting questions join running ones
between decode steps (continuous batching).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Literal, overload

import torch

from . import loader
from .adapters import AdapterPool
from .errors import EngineClosedError, InvalidRequestError, KevError
from .forward import run_model
from .kv_cache import SequenceKV
from .model_setup import context_length, eos_ids, prepare_model
from .pack import Segment, pack
from .params import Defaults, SamplingParams, check_temperature, coerce_sampling
from .request import Completion, Request, failed_future, resolve_future
from .sample import sample
from .schedule import Chunk, Scheduler
from .tokenize import Prompt, encode_prompt
from .unpack import append_token, text_delta

SamplingArg = SamplingParams | dict[str, Any] | None
AdapterArg = str | None
Prepared = tuple[list[int], SamplingParams, AdapterArg] | BaseException
STAT_KEYS = (
    "requests", "prefill_passes", "decode_steps", "forward_passes", "prompt_tokens", "generated_tokens", "cancelled"
)


_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    """Stop scheduler threads before the interpreter tears down torch's thread pools."""
    for engine in list(_live_engines):
        engine.close()


class Engine:
    """Many questions, one isolated packed forward pass.

    Args:
        model: a transformers causal LM (its attention is switched to Kev's packed attention).
        tokenizer: its tokenizer; chat prompts use its chat template.
        max_batch_tokens: token budget of one pass (prefill chunks + one token per decode).
        max_num_seqs: most questions running at once (each holds its own KV cache).
        coalesce_ms: how long an idle engine waits for concurrent callers before a pass.
        max_adapters: LoRA adapters resident on the model's device at once (others wait on the CPU).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str | None = None,
        max_batch_tokens: int = 8192,
        max_num_seqs: int = 64,
        coalesce_ms: float = 5.0,
        max_adapters: int = 4,
    ) -> None:
        prepare_model(model)
        self.model = model
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.device = next(model.parameters()).device
        self.max_context = context_length(model, tokenizer)
        self.eos_ids = eos_ids(model, tokenizer)
        self.coalesce_s = max(0.0, coalesce_ms) / 1000
        self._num_layers = model.config.get_text_config().num_hidden_layers
        self._defaults = Defaults.from_env()
        self._scheduler = Scheduler(max_batch_tokens, max_num_seqs)
        self._adapters = AdapterPool(model, self.device, max_adapters)
        self._cond = threading.Condition()
        self._forward_lock = threading.Lock()  # one pass at a time: prompt_logits vs the loop
        self._stats = dict.fromkeys(STAT_KEYS, 0)
        self._request_ids = itertools.count()
        self._groups = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._holds = 0  # > 0 while inside hold(): no new pass starts
        _live_engines.add(self)

    @classmethod
    def from_pretrained(
        cls,
        source: str | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        trust_remote_code: bool = False,
        adapters: dict[str, str] | None = None,
        **engine_kwargs: Any,
    ) -> Engine:
        """Load from a local folder, a .gguf file or a hub id; None is the embedded SmolLM2-135M-Instruct.

        `adapters` maps names to PEFT LoRA folders, loaded before the engine serves.
        """
        model, tokenizer, name = loader.load(source, device, dtype, trust_remote_code)
        engine = cls(model, tokenizer, name=name, **engine_kwargs)
        for adapter_name, path in (adapters or {}).items():
            engine.load_adapter(adapter_name, path)
        return engine

    # ---- public API -------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """The exact token ids the engine feeds for `prompt` (chat template applied to messages)."""
        return encode_prompt(self.tokenizer, prompt, self.max_context)

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingArg = None,
        adapter: AdapterArg = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Future[Completion]:
        """Queue one question; a bad one gets a future that fails alone, never an exception here.

        `on_text(piece)` streams the answer as it grows (called on the scheduler thread: keep it
        quick). Cancelling the future stops the request at the next pass.
        """
        return self._enqueue(self._prepare([prompt], [sampling], [adapter]), on_text=on_text)[0]

    def stream(self, prompt: Prompt, sampling: SamplingArg = None, adapter: AdapterArg = None) -> Iterator[str]:
        """Yield the answer's text piece by piece; it shares passes with everything else running."""
        pieces: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        future = self.submit(prompt, sampling, adapter, on_text=pieces.put)
        future.add_done_callback(lambda _: pieces.put(None))
        try:
            while (piece := pieces.get()) is not None:
                yield piece
            future.result()  # a failed request raises here, after what it streamed
        finally:
            future.cancel()  # the consumer stopped early: stop computing (no-op once finished)

    @overload
    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingArg | Sequence[SamplingArg] = None,
        return_exceptions: Literal[False] = False,
        adapters: AdapterArg | Sequence[AdapterArg] = None,
    ) -> list[Completion]: ...

    @overload
    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingArg | Sequence[SamplingArg] = None,
        return_exceptions: bool = ...,
        adapters: AdapterArg | Sequence[AdapterArg] = None,
    ) -> list[Completion | BaseException]: ...

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingArg | Sequence[SamplingArg] = None,
        return_exceptions: bool = False,
        adapters: AdapterArg | Sequence[AdapterArg] = None,
    ) -> list[Any]:  # list[Completion], or with exceptions in place when return_exceptions=True
        """Answer all prompts, packed together; results in the caller's order.

        Without `return_exceptions` any bad prompt or setting raises before anything runs;
        with it, each bad request comes back as its exception and the others are answered.
        """
        prompts = self._check_prompts(prompts)
        if not prompts:
            return []
        prepared = self._prepare(
            prompts, self._per_prompt(sampling, len(prompts), "sampling settings"),
            self._per_prompt(adapters, len(prompts), "adapters"),
        )
        if not return_exceptions:
            for item in prepared:
                if isinstance(item, BaseException):
                    raise item
        futures = self._enqueue(prepared)
        results: list[Completion | BaseException] = []
        for future in futures:
            try:
                results.append(future.result())
            except BaseException as exc:  # noqa: BLE001 - returned or re-raised
                if not return_exceptions:
                    raise
                results.append(exc)
        return results

    def prompt_logits(
        self, prompts: Sequence[Prompt], adapters: AdapterArg | Sequence[AdapterArg] = None
    ) -> list[torch.Tensor]:
        """Logits of every prompt position, [len_i, vocab] fp32 each, from ONE packed pass."""
        prompts = self._check_prompts(prompts)
        if not prompts:
            return []
        names = self._per_prompt(adapters, len(prompts), "adapters")
        distinct = sorted({n for n in names if n is not None})
        if len(distinct) > self._adapters.max_adapters:
            raise InvalidRequestError(
                f"one prompt_logits pass uses {len(distinct)} adapters {distinct}, but only "
                f"max_adapters={self._adapters.max_adapters} can be resident at once"
            )
        with self._cond:
            for name in distinct:
                self._adapters.check(name)
        ids = [self.encode(p) for p in prompts]
        segments = [Segment(i, x, 0, needs_logits=True, adapter=a) for i, (x, a) in enumerate(zip(ids, names))]
        batch = pack(segments, self.device)
        with self._cond:
            for name in names:
                self._adapters.ref(name)
            for name in names:  # a slot for each adapter, waiting while running requests pin them all
                while not self._adapters.acquire(name):
                    self._cond.wait()
        try:
            logits = self._forward(batch, all_logits=True)  # [T, vocab]
        finally:
            with self._cond:
                for name in names:
                    self._adapters.release(name)
                    self._adapters.unref(name)
                self._cond.notify_all()
        with self._cond:
            self._stats["prefill_passes"] += 1
            self._stats["forward_passes"] += 1
            self._stats["prompt_tokens"] += batch.num_tokens
        cu = batch.cu_seqlens_list
        return [logits[cu[i] : cu[i + 1]] for i in range(len(ids))]

    def stats(self) -> dict[str, int]:
        """Counters since start: requests, prefill_passes, decode_steps, forward_passes, tokens."""
        with self._cond:
            return {
                **self._stats,
                "running": len(self._scheduler.running),
                "waiting": len(self._scheduler.waiting),
                "adapter_evictions": self._adapters.evictions,
            }

    @property
    def adapters(self) -> list[str]:
        """Names of the LoRA adapters requests may use."""
        with self._cond:
            return self._adapters.names

    def load_adapter(self, name: str, path: str) -> None:
        """Hot-load a PEFT LoRA adapter; running requests are not disturbed.

        Loading the same name from the same folder again is a no-op (integration objects sharing
        an engine each declare their adapters); the same name from another folder is an error.
        """
        with self._cond:
            if self._adapters.loaded_from(name, path):
                return
        adapter = self._adapters.read(name, path)  # disk + validation, outside every lock
        with self._forward_lock, self._cond:
            self._adapters.install(adapter)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter; requests already using it finish first, new ones naming it fail."""
        with self._cond:
            self._adapters.unload(name)

    @property
    def defaults(self) -> Defaults:
        return self._defaults

    def set_defaults(self, *, temperature: float) -> Defaults:
        """Hot-update the default temperature. Requests already submitted keep the version they got."""
        value = check_temperature(temperature)
        with self._cond:
            self._defaults = Defaults(temperature=value, version=self._defaults.version + 1)
            return self._defaults

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Start no new pass while inside: everything submitted meanwhile shares the next pass.

        Coalescing without a clock: tests (and callers that know a burst is coming) submit under
        `hold()` and the pack is formed when the block exits. A pass already running finishes.
        """
        with self._cond:
            self._holds += 1
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the scheduler thread; requests still queued fail with EngineClosedError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the flow ---------------------------------------------------------------------------

    def step(self) -> int:
        """One pass: schedule → pack → forward → sample → unpack. Returns the tokens it ran."""
        with self._cond:
            for request in self._scheduler.take_cancelled():  # running ones stop computing now
                if request.cache is not None:
                    self._adapters.release(request.adapter)
                self._adapters.unref(request.adapter)
                request.cache = None
                self._stats["cancelled"] += 1
            chunks = self._scheduler.schedule(lambda r: self._adapters.acquire(r.adapter))
        if not chunks:
            return 0
        chunks.sort(key=lambda c: (c.request.adapter is not None, c.request.adapter or ""))  # adapter rows contiguous
        for chunk in chunks:
            if chunk.request.cache is None:
                self._admit(chunk.request)
        batch = pack([self._segment(c) for c in chunks], self.device)
        has_prefill = any(c.request.in_prefill for c in chunks)
        has_decode = any(not c.request.in_prefill for c in chunks)
        logits = self._forward(batch)  # [K, vocab], K = chunks that sample
        sampling = [c.request for c in chunks if c.completes_known_tokens]  # before num_computed moves
        for chunk in chunks:
            chunk.request.num_computed += chunk.num_tokens
        tokens = self._sample(logits, sampling).tolist() if sampling else []
        finished: list[tuple[Request, BaseException | None]] = []
        for request, token in zip(sampling, tokens):
            done = append_token(request, token, self.eos_ids, self.tokenizer)
            error = self._stream(request)
            if done or error is not None:
                finished.append((request, error))
        with self._cond:
            self._stats["forward_passes"] += 1
            self._stats["prefill_passes"] += has_prefill
            self._stats["decode_steps"] += has_decode
            self._stats["generated_tokens"] += len(tokens)
            for request, _ in finished:
                self._scheduler.finish(request)
                self._release(request)
        for request, error in finished:
            request.cache = None  # free its KV memory now, not when the caller drops the result
            if error is None:
                resolve_future(request.future, request.completion())
            else:
                resolve_future(request.future, exc=error)
        return batch.num_tokens

    @staticmethod
    def _stream(request: Request) -> BaseException | None:
        """Hand a request its new text; a failing `on_text` fails that request alone."""
        if request.on_text is None:
            return None
        delta = text_delta(request)
        if delta:
            try:
                request.on_text(delta)
            except Exception as exc:  # noqa: BLE001 - the caller's callback, the caller's error
                return exc
        return None

    def _forward(self, batch: Any, all_logits: bool = False) -> torch.Tensor:
        """The model on one pack, with each segment's adapter routed to its rows."""
        with self._forward_lock:
            with self._cond:
                resident = self._adapters.resident_map()
            self._adapters.router.set_routes(batch.cu_seqlens_list, batch.adapters, resident)
            try:
                return run_model(self.model, batch, all_logits=all_logits)
            finally:
                self._adapters.router.clear()

    def _release(self, request: Request) -> None:
        """Give back what a running request held (its adapter pin); call under self._cond."""
        self._adapters.release(request.adapter)
        self._adapters.unref(request.adapter)
        self._cond.notify_all()

    def _segment(self, chunk: Chunk) -> Segment:
        request = chunk.request
        start = request.num_computed
        return Segment(
            request_id=request.request_id,
            token_ids=request.all_ids[start : start + chunk.num_tokens],
            past_len=start,
            needs_logits=chunk.completes_known_tokens,
            cache=request.cache,
            adapter=request.adapter,
        )

    def _admit(self, request: Request) -> None:
        request.cache = SequenceKV(self._num_layers, request.max_total)
        if request.sampling.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(request.sampling.seed)
        with self._cond:
            self._stats["prompt_tokens"] += len(request.prompt_ids)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        settings = [r.sampling for r in requests]
        device = logits.device
        return sample(
            logits,
            temperature=torch.tensor([s.temperature for s in settings], dtype=torch.float32, device=device),
            top_p=torch.tensor([s.top_p for s in settings], dtype=torch.float32, device=device),
            top_k=torch.tensor([s.top_k for s in settings], dtype=torch.long, device=device),
            generators=[r.generator for r in requests],
        )

    # ---- requests in ------------------------------------------------------------------------

    @staticmethod
    def _check_prompts(prompts: Any) -> list[Any]:
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise InvalidRequestError(
                f"prompts must be a list of prompts (strings or chat-message lists), not {type(prompts).__name__}"
            )
        return list(prompts)

    @staticmethod
    def _per_prompt(value: Any, count: int, what: str) -> list[Any]:
        """One value for every prompt, or a list with one each."""
        if isinstance(value, (list, tuple)):
            if len(value) != count:
                raise InvalidRequestError(f"got {len(value)} {what} for {count} prompts; give one or one each")
            return list(value)
        return [value] * count

    def _prepare(self, prompts: Sequence[Any], samplings: Sequence[Any], adapters: Sequence[Any]) -> list[Prepared]:
        """Tokenize and validate each request on its own: a bad one becomes its exception."""
        prepared: list[Prepared] = []
        for prompt, sampling, adapter in zip(prompts, samplings, adapters):
            try:
                if adapter is not None and not isinstance(adapter, str):
                    raise InvalidRequestError(f"adapter={adapter!r} is not allowed; use an adapter name or None")
                with self._cond:
                    self._adapters.check(adapter)
                prepared.append((self.encode(prompt), coerce_sampling(sampling), adapter))
            except KevError as exc:
                prepared.append(exc)
        return prepared

    def _enqueue(
        self, prepared: Sequence[Prepared], on_text: Callable[[str], None] | None = None
    ) -> list[Future[Completion]]:
        """Queue all valid requests as one group; a refused one gets an already-failed future."""
        out: list[Future[Completion]] = []
        with self._cond:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            defaults = self._defaults  # one snapshot for the whole group: an update never splits it
            group_id = next(self._groups)
            group: list[Request] = []
            for item in prepared:
                if isinstance(item, BaseException):
                    out.append(failed_future(item))
                    continue
                ids, params, adapter = item
                try:
                    self._adapters.ref(adapter)  # unloaded since _prepare? then this request fails alone
                except KevError as exc:
                    out.append(failed_future(exc))
                    continue
                request = Request(
                    request_id=next(self._request_ids),
                    prompt_ids=ids,
                    sampling=params.with_defaults(defaults),
                    settings_version=defaults.version,
                    max_total=min(len(ids) + params.max_tokens, self.max_context),
                    adapter=adapter,
                    group=group_id,
                    on_text=on_text,
                )
                group.append(request)
                out.append(request.future)
            self._scheduler.add(group)
            self._stats["requests"] += len(group)
            self._start_thread()
            self._cond.notify_all()
        return out

    # ---- the scheduler thread ---------------------------------------------------------------

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kev-scheduler", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                was_idle = not self._scheduler.has_work()
                while (self._holds or not self._scheduler.has_work()) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    pending = self._scheduler.drain()
                    break
            if was_idle and self.coalesce_s:
                time.sleep(self.coalesce_s)  # let callers arriving together share the first pass
            try:
                self.step()
            except BaseException as exc:  # noqa: BLE001 - a failed pass fails its requests, not the loop
                self._fail_running(exc)
        for request in pending:
            request.cache = None
            resolve_future(request.future, exc=EngineClosedError("the engine was closed before this request finished"))

    def _fail_running(self, exc: BaseException) -> None:
        with self._cond:
            failed = list(self._scheduler.running)
            for request in failed:
                self._scheduler.finish(request)
                self._release(request)
        for request in failed:
            request.cache = None
            resolve_future(request.future, exc=exc)
