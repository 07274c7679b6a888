"""The engine: requests in, completions out, every pass packed and isolated.

    intake → schedule → pack → forward → sample → update → deliver      (docs/architecture.md)

`Engine.step()` is that whole flow once, as named stages; each stage's work lives in its own
module (`intake`, `schedule`, `pack`, `forward`, `sample`, `unpack`, `delivery`) and this file
composes them. A scheduler thread runs `step()`
while there is work, so callers of `submit()` on other threads (LangChain's thread pools,
LlamaIndex's `asyncio.gather`) coalesce into the same passes, and waiting questions join
running ones between decode steps (continuous batching). The engine owns the KV memory: a
budgeted pool of blocks, shared between questions that start with the same tokens.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Literal, overload

import torch

from . import fanout, loader
from .adapters import AdapterPool
from .backends import cuda as cuda_backend
from .backends.cuda_graphs import DecodeGraphs
from .blocks import BlockManager, BlockTable
from .delivery import Delivery, hand_text
from .errors import EngineClosedError, InvalidRequestError, KevError, PassFailedError
from .forward import run_model
from .grammar import Grammars
from .intake import AdapterArg, Intake, Prepared, SamplingArg, raise_refused
from .invariance import exact_or_why
from .kernels import choose as choose_kernels
from .kv_pool import KVPool
from .logprobs import TokenTexts
from .model_setup import check_packable, claim_model, context_length, eos_ids, prepare_model, release_model
from .pack import PackedBatch, Segment, pack
from .params import Defaults, SamplingParams, check_temperature, coerce_sampling
from .request import Completion, Request, Status, TextPiece, failed_future, resolve_future
from .sample import Draw, draw_tokens
from .schedule import Chunk, Scheduler
from .threads import run_on_passing_thread
from .tokenize import Prompt, check_prompt_list
from .unpack import append_token, text_delta

STAT_KEYS = (
    "requests", "prefill_passes", "decode_steps", "forward_passes", "prompt_tokens", "generated_tokens",
    "cancelled", "prefix_hit_tokens", "kv_cache_peak_bytes", "forked_samples",
)
EXIT_JOIN_S = 10.0  # at interpreter exit, a scheduler thread stuck in a pass (a model hook, say) is left behind
IDLE_RECHECK_S = 0.05  # a pass that could schedule nothing waits this long (or for news) before retrying


log = logging.getLogger("kev")


_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    """Stop scheduler threads before the interpreter tears down torch's thread pools."""
    for engine in list(_live_engines):
        engine.close(timeout=EXIT_JOIN_S)


def _wake_if_cancelled(cond: threading.Condition, future: Future) -> None:
    """A caller cancelled: wake the scheduler so the request frees what it holds now."""
    if future.cancelled():
        with cond:
            cond.notify_all()


def _scheduler_loop(engine_ref: weakref.ref[Engine], cond: threading.Condition) -> None:
    """The scheduler thread. It holds the engine only weakly between passes, so an engine dropped
    without close() is collected (its finalizer wakes this loop, which then ends)."""
    was_idle = True
    while True:
        with cond:
            while True:
                engine = engine_ref()
                if engine is None:
                    return
                if engine._closed or (not engine._holds and engine._scheduler.has_work()):
                    break
                was_idle = True
                del engine  # never wait holding it
                cond.wait()
            if engine._closed:
                engine._drain()
                return
        if was_idle and engine.coalesce_s:
            time.sleep(engine.coalesce_s)  # let callers arriving together share the first pass
        was_idle = False
        try:
            ran = engine.step()
        except BaseException as exc:  # noqa: BLE001 - a failed pass fails its requests, not the loop
            engine._fail_running(exc)
            ran = 1
        if not ran:
            with cond:  # nothing could run (e.g. waiting on adapter slots): wait for news, bounded
                cond.wait(IDLE_RECHECK_S)
        del engine


class Engine:
    """Many questions, one isolated packed forward pass.

    Args:
        model: a transformers causal LM (its attention is switched to Kev's packed attention
            while this engine lives; `close()` gives it back as it came).
        tokenizer: its tokenizer; chat prompts use its chat template.
        max_batch_tokens: token budget of one pass (prefill chunks + one token per decode).
        max_num_seqs: most questions running at once.
        coalesce_ms: how long an idle engine waits for concurrent callers before a pass
            (`hold()` coalesces without a clock).
        max_adapters: LoRA adapters resident on the model's device at once (others wait on the CPU).
        kv_cache_bytes: the KV memory budget (None: half the free GPU memory, or on CPU a fifth
            of the available memory up to 4 GiB — and never more than twice `max_num_seqs` full
            contexts). Admission waits for memory; nothing exceeds it.
        block_size: tokens per KV block (None: 32 on CPU, 256 on CUDA, where flash attention's paged
            KV needs a multiple of 256). Prefixes are shared in whole blocks.
        max_logits_tokens: most `prompt_logits` positions computed in one pass (each is a vocab row).
        decode_kernel: Kev's compiled CPU kernels (see `kernels`): "auto" (built once per machine;
            if they cannot be built, a warning and torch's ops), "compiled" (the kernels or an
            error), "torch" (never build them). None: `KEV_DECODE_KERNEL`, else "auto".
        batch_invariant: every answer bitwise the same packed as alone (fp32 and bf16 on CPU, with
            the compiled kernels; on CUDA with varlen_attn and Triton, not yet run on a GPU): every
            reduction in a pass has one order whatever else is in it (`invariance`). None (default):
            wherever possible, with a warning where it is not;
            True: that or an error saying why; False: torch's BLAS and attention kernels instead,
            equal only up to rounding (faster only where BLAS beats Kev's kernels).
        cuda_attention: the paged attention of a CUDA engine (`backends.cuda`): "auto" (None;
            torch's own varlen_attn, else the flash-attn package, else — with a warning saying
            why — torch's SDPA per segment), "varlen" or "flash-attn" (that kernel or an error),
            "torch" (SDPA per segment). Ignored on CPU, except that naming a kernel is an error.
        cuda_graphs: replay decode passes (no prefill chunk, no adapter) as CUDA graphs, one per
            row-count bucket (`backends.cuda_graphs`), on the paged CUDA attention; bitwise the
            eager result when batch-invariant (padding rows change nothing). False: eager.
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
        kv_cache_bytes: int | None = None,
        block_size: int | None = None,
        max_logits_tokens: int = 1024,
        decode_kernel: str | None = None,
        batch_invariant: bool | None = None,
        cuda_attention: str | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self._closed = False
        parameter = next(model.parameters())
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs={cuda_graphs!r} is not allowed; use True or False")
        paged = cuda_backend.choose(cuda_attention, parameter.device, parameter.dtype)
        flash_layout = paged is not None
        # before claiming the model: a bad mode, a failed "compiled" build or a model Kev cannot
        # pack (or not batch-invariantly, when that was asked for) leaves it as it came
        check_packable(model)
        kernels = choose_kernels(decode_kernel, parameter.device, flash_layout)
        self._exact = exact_or_why(batch_invariant, model, kernels, parameter, paged)
        claim_model(model, self)
        torch_elementwise, lora_products = prepare_model(model, kernels, self._exact)
        if torch_elementwise:  # said, not hidden: these keep torch's activation, whose last bit may move
            log.warning("Kev: batch-invariant, except that %s keep torch's own elementwise code (a last-bit "
                        "difference between packs is possible there)", ", ".join(torch_elementwise[:4]))
        self.dtype = parameter.dtype
        self.model = model
        self.tokenizer = tokenizer
        self.device = parameter.device
        self.max_context = context_length(model, tokenizer)
        self.eos_ids = eos_ids(model, tokenizer)
        self.coalesce_s = max(0.0, coalesce_ms) / 1000
        self._defaults = Defaults.from_env()
        self._kv = KVPool(model, self.device, parameter.dtype, kv_cache_bytes, block_size,
                          flash_layout=flash_layout, useful_tokens=2 * max_num_seqs * self.max_context,
                          kernels=kernels, exact=self._exact and not flash_layout)  # CUDA: varlen_attn reads it
        self._graphs: DecodeGraphs | None = None
        if paged is not None:
            paged.check_block_size(self._kv.block_size)
            paged.num_splits = 1 if self._exact else None  # one key order per query: what invariance needs
            self._kv.paged_attention = paged
            if cuda_graphs:
                trash = self._kv.reserve_last_block()
                self._kv.zero([trash])
                self._graphs = DecodeGraphs(functools.partial(run_model, model), self._kv, max_num_seqs,
                                            self.max_context, trash, capture=self.device.type == "cuda")
        self._blocks = BlockManager(self._kv.num_blocks, self._kv.block_size)
        self._scheduler = Scheduler(max_batch_tokens, max_num_seqs, self._blocks, max_logits_tokens)
        self._adapters = AdapterPool(model, self.device, max_adapters)
        self._adapters.router.kernels = lora_products  # LoRA deltas: the same products as the layers
        self._grammars = Grammars(tokenizer, _logits_width(model), self.eos_ids)
        self._token_texts = TokenTexts(tokenizer)  # logprobs name their tokens
        self._cond = threading.Condition()
        self._intake = Intake(tokenizer, self.max_context, self._kv, self._grammars, self._adapters, self._cond)
        self._step_lock = threading.Lock()  # one step at a time, whoever runs it
        self._stepping = threading.local()  # .active while this thread runs step(): a model hook runs in a pass
        self._delivery = Delivery("kev")  # on_text and results reach callers from here, never from a pass
        self._forward_lock = threading.Lock()  # one forward at a time; adapters install between passes
        self._stats = dict.fromkeys(STAT_KEYS, 0)
        self._request_ids = itertools.count()
        self._groups = itertools.count()
        self._thread: threading.Thread | None = None
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

        The loading runs on a thread that ends when it is done, so the caller's thread keeps no
        OpenMP team beside the scheduler thread's (see `threads`: that slows every pass).
        """
        def build() -> Engine:
            model, tokenizer, name = loader.load(source, device, dtype, trust_remote_code)
            engine = cls(model, tokenizer, name=name, **engine_kwargs)
            for adapter_name, path in (adapters or {}).items():
                engine.load_adapter(adapter_name, path)
            return engine
        return run_on_passing_thread(build, "kev-load")

    # ---- public API -------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """The exact token ids the engine feeds for `prompt` (chat template applied to messages)."""
        return self._intake.encode(prompt)

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingArg = None,
        adapter: AdapterArg = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Future[Completion]:
        """Queue one question; a bad one gets a future that fails alone, never an exception here.

        `on_text(piece)` streams the answer as it grows, called on one of the engine's delivery
        threads (see `delivery`): in order, all before the future resolves, and a slow callback
        delays only its own request. An exception it raises fails this request alone. Cancelling
        the future stops the request at the next pass and frees what it holds.
        """
        return self._enqueue(self._intake.prepare([prompt], [sampling], [adapter]), on_text=[on_text])[0]

    def submit_many(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingArg | Sequence[SamplingArg] = None,
        adapters: AdapterArg | Sequence[AdapterArg] = None,
        on_text: Sequence[Callable[[str], None] | None] | None = None,
    ) -> list[Future[Completion]]:
        """Queue prompts as one group (packed together, like `generate`) without waiting.

        For callers that wait on their own terms (a server, an actor): each prompt gets its own
        future, a bad one an already-failed future; `on_text[i]` streams prompt i.
        """
        prompts = check_prompt_list(prompts)
        if on_text is not None and len(on_text) != len(prompts):
            raise InvalidRequestError(f"got {len(on_text)} on_text callbacks for {len(prompts)} prompts")
        prepared = self._intake.prepare_many(prompts, sampling, adapters)
        return self._enqueue(prepared, on_text=on_text)

    def has_grammar(self, sampling: SamplingParams) -> bool:
        """Whether `sampling`'s constraint is compiled and cached (or it has none): submitting is then quick."""
        constraint = sampling.constraint
        return constraint is None or self._grammars.is_cached(constraint, sampling.cache_salt)

    def compile_grammar(self, sampling: SamplingParams) -> None:
        """Compile `sampling`'s constraint into the grammar cache now, on this thread.

        For callers that bound compile time themselves (the server compiles in a pool of its own
        with a deadline): a request submitted afterwards finds it cached. A bad constraint raises
        `ConstraintError`, as submitting it would fail its request.
        """
        if sampling.constraint is not None:
            self._grammars.compile(sampling.constraint, sampling.cache_salt)

    def stream(self, prompt: Prompt, sampling: SamplingArg = None, adapter: AdapterArg = None) -> Iterator[str]:
        """Yield the answer's text piece by piece; it shares passes with everything else running.

        One answer: a request with n > 1 is refused here (submit it with an `on_text`, whose pieces
        say which sample they belong to in `TextPiece.sample_index`)."""
        self._refuse_on_scheduler_thread("stream")
        try:
            samples = coerce_sampling(sampling).n
        except KevError:
            samples = 1  # a bad setting fails the request's future below, as submit does
        if samples > 1:
            raise InvalidRequestError(f"stream() yields one answer; n={samples} asks for {samples}: use submit() "
                                      "with on_text (each piece's .sample_index names its sample)")
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
        """Answer all prompts, packed together; results in the caller's order, one per prompt.

        A prompt whose settings ask for n > 1 samples still gets one result: its first sample's
        `Completion`, holding all n in `samples` (its prompt computed once, see `fanout`).
        Without `return_exceptions` any bad prompt or setting raises before anything runs;
        with it, each bad request comes back as its exception and the others are answered.
        If this call ends early (an error, Ctrl-C), the requests it queued are cancelled.
        """
        return self._answer("generate", prompts, sampling, adapters, return_exceptions)

    def generate_with_logits(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingArg | Sequence[SamplingArg] = None,
        adapters: AdapterArg | Sequence[AdapterArg] = None,
    ) -> list[tuple[Completion, torch.Tensor]]:
        """`generate`, each answer with the logits its tokens were drawn from: [tokens, vocab] fp32,
        the model's own (before penalties, grammar masks and temperature). What `kev verify`
        compares packed against alone; one sample per prompt (n = 1). Bad input raises first."""
        return self._answer("generate_with_logits", prompts, sampling, adapters, capture_logits=True)

    def prompt_logits(
        self, prompts: Sequence[Prompt], adapters: AdapterArg | Sequence[AdapterArg] = None
    ) -> list[torch.Tensor]:
        """Logits of every prompt position, [len_i, vocab] fp32 each, packed like everything else.

        The prompts go through the scheduler with the rest of the engine's work: at most
        `max_logits_tokens` positions per pass (long prompts in chunks), adapter slots taken as
        for any request, and each result is its own tensor (not a view of a whole pass). They
        never start from a cached prefix: every position's logits are computed.
        """
        return self._answer("prompt_logits", prompts, None, adapters, logits_only=True)

    def stats(self) -> dict[str, Any]:
        """Counters since start (requests, passes, tokens, prefix hits), the KV memory now, and how
        this engine computes (its dtype, and whether packed equals alone bit for bit)."""
        with self._cond:
            return {
                **self._stats,
                "dtype": str(self.dtype).removeprefix("torch."),
                "batch_invariant": self._exact,
                "running": len(self._scheduler.running),
                "waiting": len(self._scheduler.waiting),
                "preemptions": self._scheduler.preemptions,
                "adapter_evictions": self._adapters.evictions,
                "kv_cache_bytes": self._blocks.num_used * self._kv.block_bytes,
                "kv_cached_prefix_bytes": len(self._blocks.cached) * self._kv.block_bytes,
                "kv_prefix_evictions": self._blocks.evictions,
                "kv_cache_budget_bytes": self._kv.budget_bytes,
                "kv_block_size": self._kv.block_size,
                "grammar_compiles": self._grammars.compiles,
                "grammar_cache_hits": self._grammars.cache_hits,
                "grammar_cache_bytes": self._grammars.cached_bytes,
            }

    @property
    def batch_invariant(self) -> bool:
        """Whether every answer is bitwise the same packed as alone (see `invariance`)."""
        return self._exact

    @property
    def decode_attention(self) -> str:
        """Which attention serves decode rows: "exact" (the batch-invariant CPU kernel, prefill rows
        too), "varlen" or "flash-attn" (the paged CUDA kernel, prefill rows too), "compiled" (the CPU
        decode kernel) or "torch"."""
        if self._kv.exact is not None:
            return "exact"
        if self._kv.paged_attention is not None:
            return str(self._kv.paged_attention.name)
        return "compiled" if self._kv.paged_decode is not None else "torch"

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode passes replay CUDA graphs (see `backends.cuda_graphs`)."""
        return self._graphs is not None

    @property
    def adapters(self) -> list[str]:
        """Names of the LoRA adapters requests may use."""
        with self._cond:
            return self._adapters.names

    def load_adapter(self, name: str, path: str) -> None:
        """Hot-load a PEFT LoRA adapter; running requests are not disturbed.

        Loading the same name from the same folder again is a no-op (integration objects sharing
        an engine each declare their adapters); the same name from another folder is an error.
        A reload (unload, then load) is a new adapter: no KV computed under the old one is reused.
        """
        with self._cond:
            if self._adapters.loaded_from(name, path):
                return
        # disk + validation, outside every lock, on a thread that ends (no OpenMP team left here)
        adapter = run_on_passing_thread(lambda: self._adapters.read(name, path), "kev-load-adapter")
        with self._forward_lock, self._cond:
            self._adapters.install(adapter)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter; requests already using it finish first, new ones naming it fail.

        Until they finish the adapter is draining (`draining_adapters`); unloading it again then
        changes nothing, and loading its name again fails until `wait_for_unload` says it is gone.
        """
        with self._cond:
            self._adapters.unload(name)

    @property
    def draining_adapters(self) -> dict[str, int]:
        """Adapters unloaded while requests still use them → how many requests still do."""
        with self._cond:
            return self._adapters.draining

    def wait_for_unload(self, name: str, timeout: float) -> bool:
        """Wait up to `timeout` s for a draining adapter's last request; True once `name` is gone
        (at once for a name that is not draining), False if it is still draining."""
        self._refuse_on_scheduler_thread("wait_for_unload")  # it would wait for the requests it blocks
        with self._cond:  # every finished request notifies the condition (`_free`)
            return self._cond.wait_for(lambda: name not in self._adapters.unloading, timeout)

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

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = None) -> None:
        """Stop the scheduler thread; requests still queued or running fail with EngineClosedError.
        The model is given back as it came (its own attention, no LoRA wrappers).

        `timeout` bounds the wait for a pass in progress (None: wait for it); if it passes, the
        thread (stuck in a model hook, say) is left to end on its own and the model is not touched.
        Callbacks still being delivered run on after it returns.
        """
        with self._cond:
            if self._closed and self._thread is None:
                return
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                return
        with self._forward_lock, self._cond:
            self._drain()
            self._adapters.restore_model()
            release_model(self.model)
            self._thread = None
        self._delivery.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the flow ---------------------------------------------------------------------------

    def step(self) -> int:
        """One pass: cancel → schedule → pack → forward → sample → postprocess → finish.

        Returns the number of tokens it ran (0: nothing could run). Passes never overlap: a caller
        stepping by hand (inside `hold()`) waits for the scheduler thread's pass to end.
        """
        with self._step_lock:
            self._stepping.active = True
            try:
                return self._step()
            finally:
                self._stepping.active = False

    def _step(self) -> int:
        self._cancel()
        chunks = self._schedule()
        if not chunks:
            return 0
        try:
            batch = self._pack(chunks)
            logits = self._forward(batch)  # [K, vocab]
        finally:
            with self._cond:
                self._blocks.end_pass()
        tokens = self._sample(chunks, batch, logits)
        finished = self._postprocess(chunks, batch, logits, tokens)
        self._finish(finished)
        return batch.num_tokens

    def _cancel(self) -> None:
        """Requests whose caller cancelled them leave now and free what they hold."""
        with self._cond:
            for request in self._scheduler.take_cancelled():
                self._free(request)
                self._stats["cancelled"] += request.future.cancelled()  # not those failed by their on_text

    def _schedule(self) -> list[Chunk]:
        """This pass's chunks; each admitted request gets its KV blocks and its adapter's slot."""
        with self._cond:
            chunks = self._scheduler.schedule(self._admit, lambda r: self._adapters.release(r.adapter))
            fresh = self._blocks.take_fresh()
            used = self._blocks.num_used * self._kv.block_bytes
            self._stats["kv_cache_peak_bytes"] = max(self._stats["kv_cache_peak_bytes"], used)
        self._kv.zero(fresh)  # before this pass's forward (steps never overlap)
        chunks.sort(key=lambda c: (c.request.adapter is not None, c.request.adapter or ""))  # adapter rows contiguous
        return chunks

    def _admit(self, request: Request) -> bool:
        """Called under self._cond when a request's KV fits: take its adapter slot, or wait."""
        if not self._adapters.acquire(request.adapter):
            return False
        self._seed(request)
        if request.num_admissions == 0:
            self._stats["prompt_tokens"] += len(request.prompt_ids)
        self._stats["prefix_hit_tokens"] += request.num_computed
        request.num_admissions += 1
        return True

    def _seed(self, request: Request) -> None:
        """A seeded request's own generator, made once (a preempted one keeps drawing from it)."""
        if request.sampling.seed is not None and request.generator is None:
            request.generator = torch.Generator(device=self.device).manual_seed(request.sampling.seed)

    def _pack(self, chunks: list[Chunk]) -> PackedBatch:
        segments = []
        for chunk in chunks:
            request, start = chunk.request, chunk.request.num_computed
            segments.append(Segment(
                request_id=request.request_id,
                token_ids=request.all_ids[start : start + chunk.num_tokens],
                past_len=start,
                needs_logits=chunk.samples,
                block_ids=request.blocks.block_ids,
                adapter=request.adapter,
                all_logits=request.logits_only,
            ))
        return pack(segments, self.device, self._kv)

    def _forward(self, batch: PackedBatch) -> torch.Tensor:
        """The model on one pack, with each segment's adapter routed to its rows."""
        with self._forward_lock:
            with self._cond:
                resident = self._adapters.resident_map()
            self._adapters.router.set_routes(batch.cu_seqlens_list, batch.adapters, resident)
            try:
                if self._graphs is not None and self._graphs.fits(batch):
                    return self._graphs.run(batch)
                return run_model(self.model, batch)
            finally:
                self._adapters.router.clear()

    def _sample(self, chunks: list[Chunk], batch: PackedBatch, logits: torch.Tensor) -> list[Draw]:
        """One token for every chunk that reached its request's last known token — and, at the first
        token of an n > 1 request, for each of its other samples forked from that prefill: they
        draw from the same row.

        How a row is drawn (penalties, grammar mask, the draw, logprobs) is `sample.draw_tokens`'s.
        """
        plan = [(c.request, batch.logits_rows[i][0]) for i, c in enumerate(chunks) if c.samples]
        if not plan:
            return []
        plan += [(sibling, row) for request, row in plan if request.siblings for sibling in self._fork(request)]
        return draw_tokens(plan, logits, self.eos_ids, self._grammars.vocab_size, self._token_texts)

    def _fork(self, leader: Request) -> list[Request]:
        """The samples waiting on `leader` that start from its prefill now (see `fanout`); those
        that cannot for now (no free block or sequence slot) queue as requests of their own."""
        forked: list[Request] = []
        queued: list[Request] = []
        copies: list[tuple[int, int]] = []
        with self._cond:
            siblings, leader.siblings = leader.siblings, []
            for sibling in siblings:
                if sibling.future.done():  # its set was cancelled or failed meanwhile
                    self._free(sibling)
                    continue
                pairs = None
                if len(self._scheduler.running) < self._scheduler.max_num_seqs:
                    pairs = self._blocks.fork(leader.blocks, sibling.blocks, len(leader.prompt_ids))
                if pairs is None:
                    queued.append(sibling)
                    continue
                copies += pairs
                self._adapters.acquire(sibling.adapter)  # pinned by the leader already: never refused
                self._seed(sibling)
                sibling.num_computed = sibling.cached_tokens = len(sibling.prompt_ids)
                sibling.num_admissions = 1  # its prompt tokens were counted with the leader's
                self._scheduler.adopt(sibling)
                forked.append(sibling)
            self._scheduler.requeue(queued)
            self._stats["forked_samples"] += len(forked)
        fanout.copy_blocks(self._kv, copies)  # before the next pass writes into the copies
        return forked

    def _postprocess(
        self, chunks: list[Chunk], batch: PackedBatch, logits: torch.Tensor, draws: list[Draw]
    ) -> list[tuple[Request, BaseException | None]]:
        """Advance each request by what this pass computed; return those that are done."""
        finished: list[tuple[Request, BaseException | None]] = []
        has_prefill = any(c.request.in_prefill for c in chunks)
        has_decode = any(not c.request.in_prefill for c in chunks)
        with self._cond:
            self._scheduler.update(chunks)
            self._stats["forward_passes"] += 1
            self._stats["prefill_passes"] += has_prefill
            self._stats["decode_steps"] += has_decode
            self._stats["generated_tokens"] += len(draws)
        for i, chunk in enumerate(chunks):
            request = chunk.request
            if request.logits_only:
                first, last = batch.logits_rows[i]
                request.logits.append(logits[first:last].clone())  # its own memory, not a view of the pass
                if not request.in_prefill:
                    finished.append((request, None))
        for request, row, token, logprob in draws:
            if isinstance(token, BaseException):
                finished.append((request, token))
                continue
            if request.capture_logits:
                request.logits.append(logits[row].clone())
            if logprob is not None and request.logprobs is not None:
                request.logprobs.append(logprob)
            if append_token(request, token, self.eos_ids, self.tokenizer):
                finished.append((request, None))
            self._stream(request)
        return finished

    def _finish(self, finished: list[tuple[Request, BaseException | None]]) -> None:
        """Free what finished requests hold, then hand each caller its result (outside the lock)."""
        with self._cond:
            for request, _ in finished:
                self._scheduler.finish(request)
                self._free(request)
        for request, error in finished:
            self._deliver(request, request.result() if error is None else None, error)

    def _free(self, request: Request) -> None:
        """Everything a request holds, given back in one place (call under self._cond). Samples still
        waiting to fork from it hold only their adapter references; their set's future settles them."""
        for sibling in request.siblings:
            self._free(sibling)
        request.siblings = []
        if request.status is Status.FINISHED:
            return
        if request.status is Status.RUNNING:
            self._blocks.free(request.blocks)
            self._adapters.release(request.adapter)
        self._adapters.unref(request.adapter)
        request.status = Status.FINISHED
        self._cond.notify_all()

    def _stream(self, request: Request) -> None:
        """Post a request's new text to its `on_text` (run by the delivery threads, after what it
        was posted before: this pass never waits for the callback). If the callback raises, the
        request's future fails and the next pass frees it (`Scheduler.take_cancelled`). The piece
        carries its sample's index and the logprobs of the tokens since the previous piece."""
        if request.on_text is not None and (delta := text_delta(request)):
            logprobs = None
            if request.logprobs is not None:
                logprobs = request.logprobs[request.logprobs_streamed:]
                request.logprobs_streamed = len(request.logprobs)
            piece = TextPiece(delta, request.sample_index, logprobs)
            self._delivery.post(request.mailbox, functools.partial(hand_text, request.future, request.on_text, piece))

    def _deliver(self, request: Request, result: Any, exc: BaseException | None = None) -> None:
        """Resolve a request's future after every piece of text it streamed (its done callbacks
        then run on a delivery thread, not in a pass)."""
        self._delivery.post(request.mailbox, functools.partial(resolve_future, request.future, result, exc))

    # ---- requests in ------------------------------------------------------------------------

    def _refuse_on_scheduler_thread(self, what: str) -> None:
        """A blocking call from inside a pass (a model hook) waits for the pass it blocks. From a
        delivery thread (an on_text or future callback) it holds a thread that answers need: once
        every delivery thread waits like that, its own answer can never be delivered."""
        on_scheduler = self._thread is not None and threading.current_thread() is self._thread
        if on_scheduler or getattr(self._stepping, "active", False) or self._delivery.owns_current_thread():
            raise InvalidRequestError(
                f"Engine.{what}() was called from an engine callback (on_text or a future's done callback) or "
                "inside a pass; it would wait on the engine from the engine's own threads, possibly forever. "
                "Use submit() there, or hand the work to another thread"
            )

    def _enqueue(
        self,
        prepared: Sequence[Prepared],
        on_text: Sequence[Callable[[str], None] | None] | None = None,
        logits_only: bool = False,
        capture_logits: bool = False,
    ) -> list[Future[Any]]:
        """Queue all valid requests as one group; a refused one gets an already-failed future."""
        out: list[Future[Any]] = []
        with self._cond:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            defaults = self._defaults  # one snapshot for the whole group: an update never splits it
            group_id = next(self._groups)
            group: list[Request] = []
            for i, item in enumerate(prepared):
                if isinstance(item, BaseException):
                    out.append(failed_future(item))
                    continue
                ids, params, adapter, compiled = item
                resolved = params.with_defaults(defaults)
                samples = fanout.sample_settings(resolved) if resolved.n > 1 else [resolved]
                try:
                    for _ in samples:
                        self._adapters.ref(adapter)  # unloaded since intake? then this request fails alone
                except KevError as exc:
                    out.append(failed_future(exc))
                    continue
                requests = [Request(
                    request_id=next(self._request_ids),
                    prompt_ids=ids,
                    sampling=sample,
                    settings_version=defaults.version,
                    max_total=len(ids) + 1 if logits_only else min(len(ids) + params.max_tokens, self.max_context),
                    adapter=adapter,
                    prefix_key=(self._adapters.prefix_key(adapter), params.cache_salt),
                    logits_only=logits_only,
                    capture_logits=capture_logits,
                    blocks=BlockTable(cacheable=not logits_only),
                    group=group_id,
                    on_text=on_text[i] if on_text is not None else None,
                    matcher=None if compiled is None or logits_only else self._grammars.matcher(compiled),
                    logprobs=[] if sample.logprobs else None,
                    sample_index=index,
                ) for index, sample in enumerate(samples)]
                leader = requests[0]
                leader.siblings = requests[1:]  # they fork from its prefill (see `fanout`)
                for request in requests:
                    request.mailbox = leader.mailbox  # one on_text: the samples' pieces and results in one order
                    request.future.add_done_callback(functools.partial(_wake_if_cancelled, self._cond))
                group.append(leader)
                out.append(fanout.gather([r.future for r in requests]) if len(requests) > 1 else leader.future)
            self._scheduler.add(group)
            self._stats["requests"] += len(group)
            self._start_thread()
            self._cond.notify_all()
        return out

    def _answer(self, what: str, prompts: Sequence[Prompt], sampling: Any, adapters: Any,
                return_exceptions: bool = False, capture_logits: bool = False, logits_only: bool = False) -> list[Any]:
        """The blocking calls' one path: prepare every prompt, queue them as one group, wait for all.
        Without `return_exceptions` a refused prompt raises before anything is queued."""
        self._refuse_on_scheduler_thread(what)
        prompts = check_prompt_list(prompts)
        if not prompts:
            return []
        prepared = self._intake.prepare_many(prompts, sampling, adapters)
        if not return_exceptions:
            raise_refused(prepared)
        if capture_logits:
            for item in prepared:
                if not isinstance(item, BaseException) and item[1].n != 1:
                    raise InvalidRequestError(f"n={item[1].n} is not allowed with {what}; "
                                              "it keeps one answer's logits per prompt (n=1)")
        queued = self._enqueue(prepared, capture_logits=capture_logits, logits_only=logits_only)
        return self._wait(queued, return_exceptions)

    def _wait(self, futures: list[Future[Any]], return_exceptions: bool) -> list[Any]:
        """Collect results in order; if this caller stops early, cancel what it queued."""
        results: list[Any] = []
        try:
            for future in futures:
                try:
                    results.append(future.result())
                except Exception as exc:  # noqa: BLE001 - returned in place, or re-raised
                    if not return_exceptions:
                        raise
                    results.append(exc)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return results

    # ---- the scheduler thread ---------------------------------------------------------------

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=_scheduler_loop, args=(weakref.ref(self), self._cond), name="kev-scheduler", daemon=True
            )
            weakref.finalize(self, _notify, self._cond)
            self._thread.start()

    def _drain(self) -> None:
        """Fail every request still queued or running (call under self._cond, engine closed)."""
        pending = self._scheduler.drain()
        for request in pending:
            self._free(request)
        for request in pending:
            self._deliver(request, None, EngineClosedError("the engine was closed before this request finished"))

    def _fail_running(self, exc: BaseException) -> None:
        """A pass raised: its requests fail, each with its own error chained to the cause."""
        with self._cond:
            failed = list(self._scheduler.running)
            for request in failed:
                self._scheduler.finish(request)
                self._free(request)
        for request in failed:
            error = PassFailedError(f"the forward pass this request was in failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._deliver(request, None, error)


def _logits_width(model: Any) -> int:
    """How many logits the model emits per position (its lm_head rows; may exceed the tokenizer)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.config.vocab_size)


def _notify(cond: threading.Condition) -> None:
    with cond:
        cond.notify_all()
