"""The engine: requests in, completions out, every pass packed and isolated.

    intake → schedule → pack → forward → sample → record → deliver      (docs/architecture.md)

This file composes the components and keeps the public API; each stage's work is its package's:
`inputs` (prompts and settings → checked requests, or each its own error), `core` (every
request from queued to delivered and what it holds, which tokens run next under the time, token
and KV budgets, the worker thread and when its first pass after idle starts), `model` (pack and
forward), `adapters` (LoRA per segment), `sample` (each row's draw), `outputs` (text and delivery),
and `platforms` (how this device computes: chosen once here, by `platforms.choose`). The KV memory
is a budgeted pool of blocks, shared between questions that start with the same tokens.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import math
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Literal, overload

import torch

from . import loader, models, platforms
from .adapters.pool import AdapterPool
from .adapters.pool import check_name as check_adapter_name
from .core import drafts, fanout, pass_cost
from .core.arrivals import Arrival, Arrivals, running_loop
from .core.blocks import BlockManager
from .core.delivery import Delivery
from .core.request import Status
from .core.schedule import Scheduler
from .core.worker import Worker
from .draft_model import DraftModel, draft_engine
from .errors import EngineClosedError, InvalidRequestError, KevError
from .inputs.intake import AdapterArg, Intake, Prepared, SamplingArg, raise_refused
from .inputs.params import MAX_TOP_LOGPROBS, Defaults, SamplingParams, check_temperature, coerce_sampling
from .inputs.tokenize import Prompt, check_prompt_list
from .model.setup import check_packable, claim_model, context_length, eos_ids, prepare_model, release_model
from .models.quant import QuantWeight
from .outputs.processor import OutputProcessor
from .platforms.threads import run_on_passing_thread, use_threads
from .results import Completion
from .runner import ModelRunner
from .sample import logprobs
from .sample.grammar import Grammars
from .sample.logprobs import PromptLogprobs, TokenTexts
from .sample.sample import Sampler
from .stepper import Stepper

log = logging.getLogger("kev")


class Engine:
    """Many questions, one isolated packed forward pass.

    Args:
        model: a transformers causal LM, or Kev's own model (`models.DecoderModel`, what
            `from_pretrained` loads for the families Kev owns). On Kev's path (`model_impl`) the
            engine computes with its own forward over the model's tensors, and `engine.model` is
            Kev's model: forward hooks on the transformers model are not run. On the fallback its
            attention is switched to Kev's packed attention while this engine lives (`close()`
            gives it back as it came), and hooks and replaced modules are honoured.
        tokenizer: its tokenizer; chat prompts use its chat template.
        max_batch_tokens: most tokens in one pass (prefill chunks + one token per decode): a hard cap.
        pass_time_ms: how long anyone waits for a pass (None: `KEV_PASS_TIME_MS`, else 300 on CPU,
            100 on CUDA). On Kev's own model a batch is one pass (up to `max_batch_tokens`) that
            runs in slices of about this long (`stepper`): between two, while anything else is
            queued or answering, every running answer gets its next token and a question that
            arrived starts. On the transformers fallback, which cannot pause, the scheduler fills
            each pass up to this instead (`pass_cost` learns what the work costs): a long prompt
            goes on in chunks, and a batch whose work does not fit runs in consecutive passes.
            `math.inf`: passes bounded by `max_batch_tokens` alone, never paused.
        max_num_seqs: most questions running at once.
        max_model_len: the longest question (prompt and answer) this engine takes, at most the
            model's context (None: the model's `max_position_embeddings`). A model with a sliding
            window narrower than its context (Mistral-7B-v0.1: 4096) loads only with this at most
            the window: Kev's packed attention has no window, and then needs none.
        coalesce_ms: the quiet window an idle engine waits for concurrent callers before its first
            pass: it starts once nobody arrived for this long and no caller is still submitting, and
            widens itself (up to 8 times) when a burst's stragglers missed it (`arrivals`). 0: start
            at once. `hold()` coalesces without a clock.
        max_adapters: LoRA adapters resident on the model's device at once (others wait on the CPU).
        kv_cache_bytes: the KV memory budget (None: half the free GPU memory, or on CPU a fifth
            of the available memory up to 4 GiB — and never more than twice `max_num_seqs` full
            contexts). Admission waits for memory; nothing exceeds it.
        block_size: tokens per KV block (None: 32, or 256 with a paged CUDA kernel, whose blocks
            must be a multiple of 256). Prefixes are shared in whole blocks.
        max_logits_tokens: most `prompt_logits` positions computed in one pass (each is a vocab row).
        threads: the CPU threads that compute (None: `KEV_THREADS`, else torch's default, one per
            physical core). Process-wide, as torch's own count is. Kev's kernels hand their work
            out to whichever thread is free, so another program taking a core slows a pass by
            that core's share, not by a whole barrier per call.
        cpu_kernels: Kev's compiled CPU kernels, for every product and attention they cover (see
            `platforms.cpu.kernels`): "auto" (built once per environment; if they cannot be built,
            a warning and torch's ops), "compiled" (the kernels or an error), "torch" (never build
            them). None: `KEV_CPU_KERNELS`, else "auto".
        batch_invariant: every answer bitwise the same packed as alone (fp32 and bf16 on CPU, with
            the compiled kernels; on CUDA with varlen_attn and Triton): every reduction in a pass
            has one order whatever else is in it (`platforms.invariance`). None (default):
            wherever possible, with a warning where it is not;
            True: that or an error saying why; False: torch's BLAS and attention kernels instead,
            equal only up to rounding (faster only where BLAS beats Kev's kernels).
        cuda_attention: the attention of a CUDA engine (`platforms.cuda.choice`): "auto" (None;
            torch's own paged varlen_attn (torch 2.12 and later), else Kev's Triton kernel over
            the pool, else varlen_attn over gathered keys (2.10 and 2.11), else the flash-attn
            package, else — with a warning saying why — torch's SDPA per segment), "varlen",
            "triton" or "flash-attn" (that kernel or an error), "torch" (SDPA per segment). Each
            kernel is tried on a probe pack first. Ignored on CPU, except that naming a kernel is
            an error.
        model_impl: which forward computes, with vLLM's names: "kev" (Kev's own, for the Llama,
            Mistral, Qwen2 and Qwen3 families: an error for others), "transformers" (the
            transformers model through Kev's attention), "auto" (None: Kev's where the family is
            Kev's, else transformers'). `stats()["model_impl"]` says which runs.
        speculative: drafts verified inside the packed pass (`core.drafts`): "ngram" (each
            decoding question's next tokens looked up in its own prompt and answer, the rows that
            price in beside its token, the tokens it would have written taken), "model" (the
            drafts written greedily by `draft_model`), "off", or "auto" (None: `KEV_SPECULATIVE`,
            else "auto": "model" with a draft model, else "ngram", where the engine is
            batch-invariant). Every token, logprob and finish reason is bitwise what it is with
            "off", greedy and seeded alike; drafts are refused where the engine is not
            batch-invariant. On CUDA no draft row is priced in yet (`Platform.rows_alike`: a draft
            would take a decode pass off its graph). `stats()` counts `draft_tokens` and
            `draft_accepted_tokens`.
        draft_model: for speculative="model", a smaller model with this model's tokenizer (its
            folder, .gguf file or hub id, loaded in this model's dtype and device and closed with
            this engine; or a Kev `Engine` built with speculative="off", left open). It drafts
            before each pass where drafting has paid lately (`draft_model`); `stats()` says how
            long it took (`draft_seconds`).
        cuda_graphs: replay Kev's own model's decode passes (no prefill chunk, no adapter) as
            CUDA graphs, one per row-count bucket (`platforms.cuda.graphs`), on a paged CUDA
            attention; bitwise the eager result when batch-invariant (padding rows change
            nothing). False: eager. The transformers fallback always runs eagerly.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str | None = None,
        max_batch_tokens: int = 8192,
        pass_time_ms: float | None = None,
        max_num_seqs: int = 64,
        coalesce_ms: float = 5.0,
        max_adapters: int = 4,
        kv_cache_bytes: int | None = None,
        block_size: int | None = None,
        max_logits_tokens: int = 1024,
        cpu_kernels: str | None = None,
        batch_invariant: bool | None = None,
        cuda_attention: str | None = None,
        cuda_graphs: bool = True,
        max_model_len: int | None = None,
        threads: int | None = None,
        model_impl: str | None = None,
        speculative: str | None = None,
        draft_model: Any = None,
    ) -> None:
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.dtype_choice = "the model's own dtype"  # from_pretrained(dtype="auto") says why it chose
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs={cuda_graphs!r} is not allowed; use True or False")
        impl = models.choose_impl(model_impl, model.config)
        self.threads = use_threads(threads)
        # before anything about a transformers model changes: a bad mode, a failed "compiled" build
        # or a model Kev cannot pack (or not batch-invariantly, when that was asked for) leaves it as it came
        max_context = context_length(model, tokenizer, max_model_len)
        check_packable(model, max_context)
        if impl == "kev" and not isinstance(model, models.DecoderModel):
            model = models.from_module(model)  # Kev's layout over the transformers model's tensors
        elif impl == "transformers" and isinstance(model, models.DecoderModel):
            raise ValueError("model_impl='transformers' needs a transformers model; this one is Kev's own "
                             "(Engine.from_pretrained(..., model_impl='transformers') loads one)")
        self._platform = platforms.choose(model, cpu_kernels=cpu_kernels, batch_invariant=batch_invariant,
                                          cuda_attention=cuda_attention, cuda_graphs=cuda_graphs)
        self._platform.use_threads(self.threads)
        self.speculative = drafts.speculative_mode(speculative, self._platform.batch_invariant,
                                                   draft_model=draft_model is not None)
        self._draft = None if self.speculative != "model" else self._draft_model(draft_model, model, tokenizer)
        if impl == "kev":
            model.use(self._platform.ops())
        else:
            claim_model(model, self)
            prepare_model(model)
            torch_elementwise = self._platform.install(model)
            if torch_elementwise:  # said, not hidden: these keep torch's activation, whose last bit may move
                log.warning("Kev: batch-invariant, except that %s keep torch's own elementwise code (a last-bit "
                            "difference between packs is possible there)", ", ".join(torch_elementwise[:4]))
        self.model_impl = impl
        self.model, self.tokenizer = model, tokenizer
        # what the weights take, once: they do not change while the engine serves (None: a fallback model)
        self._weight_bytes = model.weight_bytes() if isinstance(model, models.DecoderModel) else None
        parameter = next(model.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        self.max_context = max_context
        self.eos_ids = eos_ids(model, tokenizer)
        self._defaults = Defaults.from_env()
        self._backend = self._platform.attention
        self._kv = self._backend.allocate(model, self.device, self.dtype, kv_cache_bytes, block_size,
                                          useful_tokens=2 * max_num_seqs * self.max_context,
                                          default_bytes=self._platform.default_kv_cache_bytes)
        self._adapters = AdapterPool(model, self.device, max_adapters)
        if impl == "transformers":  # its LoRA layers compute with the platform's products (Kev's model: its ops')
            self._adapters.router.products = self._platform.lora_products
        graphs = None
        if impl == "kev":  # may reserve a block
            graphs = self._platform.decode_graphs(functools.partial(model.forward, backend=self._backend),
                                                  max_num_seqs, self.max_context)
        self._runner = ModelRunner(model, self._backend, self._adapters, device=self.device, graphs=graphs)
        self._blocks = BlockManager(self._kv.num_blocks, self._kv.block_size)
        self.pass_time_ms = pass_cost.target_ms(pass_time_ms, self._platform.default_pass_ms)
        self._cond = threading.Condition()  # the engine's one lock: requests, blocks, adapters, the worker
        self._scheduler = Scheduler(max_batch_tokens, max_num_seqs, self._blocks, max_logits_tokens,
                                    cost=pass_cost.CostModel(pass_cost.Work.of(model)),
                                    pass_time_s=self.pass_time_ms / 1000, adapters=self._adapters,
                                    max_context=self.max_context,
                                    on_cancel=functools.partial(_wake_if_cancelled, self._cond))
        self._scheduler.speculative = self.speculative != "off"
        if self._draft is not None:
            self._scheduler.drafter = drafts.ModelDrafter
            self._draft.saved_per_token = self._scheduler.decode_row_seconds
        self._scheduler.rows_alike = functools.partial(self._platform.rows_alike, dtype=self.dtype)
        self._scheduler.keys_answers = impl != "kev" or not model.ops.prompt_arithmetic
        self._grammars = Grammars(tokenizer, _logits_width(model), self.eos_ids)
        self._intake = Intake(tokenizer, self.max_context, self._kv, self._grammars, self._adapters, self._cond)
        self._token_texts = TokenTexts(tokenizer)  # logprobs name their tokens
        self._delivery = Delivery("kev")  # on_text and results reach callers from its threads, never from a pass
        arrivals = Arrivals(max(0.0, coalesce_ms) / 1000)  # under the engine's lock
        self._arrivals = arrivals
        self._outputs = OutputProcessor(tokenizer, self.eos_ids, self._delivery)
        self._stepper = Stepper(cond=self._cond, scheduler=self._scheduler, runner=self._runner,
                                sampler=Sampler(self._grammars, self.eos_ids, self._token_texts),
                                outputs=self._outputs, arrivals=arrivals, drafts=self._draft)
        self._worker = Worker(self._stepper, self._cond, arrivals, enter=self._platform.enter_pass_thread)
        self._given_back = False  # close() drained the requests and gave the model back
        _live.add(self)  # closed at interpreter exit, before torch tears down its thread pools

    def _draft_model(self, draft_model: Any, model: Any, tokenizer: Any) -> DraftModel:
        """The draft model's engine (built in this model's dtype and device where `draft_model` is
        a name), checked against this model's tokenizer, before anything about `model` changes."""
        parameter = next(model.parameters())
        engine, owned = draft_engine(draft_model, dtype=parameter.dtype, device=parameter.device,
                                     threads=self.threads)
        try:
            return DraftModel(engine, owned, tokenizer, _embedding_rows(model))
        except BaseException:
            if owned:
                engine.close()
            raise

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        trust_remote_code: bool = False,
        adapters: dict[str, str] | None = None,
        weights: str | None = None,
        **engine_kwargs: Any,
    ) -> Engine:
        """Load `model` from a local folder, a .gguf file or a hub id; None is the embedded SmolLM2-135M-Instruct.

        `weights`: how a GGUF's quantized weights are kept — "as-stored" (computed in place by Kev's
        CPU kernels: the file's size in memory, within rounding of dequantized), "dense" (dequantized
        into `dtype`), or "auto"/None (as stored where the engine can compute them so); see `loader`.

        `model` is the name `ChatKev`, LlamaIndex's `Kev`, `kev --model` and vLLM's `LLM(model=...)`
        use. `adapters` maps names to PEFT LoRA folders, loaded before the engine serves.
        `engine_kwargs` are `Engine`'s settings; they are checked before the (slow) load.

        The loading runs on a thread that ends when it is done, so the caller's thread keeps no
        OpenMP team beside the scheduler thread's (see `threads`: that slows every pass).
        """
        _check_engine_kwargs(cls, engine_kwargs)

        def build() -> Engine:
            chosen, why = dtype, None
            if dtype is None or dtype == "auto":  # decided here, once, so the engine can say why
                chosen, why = platforms.auto_dtype(loader.resolve_device(device))
            loaded, tokenizer, name = loader.load(model, device, chosen, trust_remote_code,
                                                  engine_kwargs.get("model_impl"), weights,
                                                  engine_kwargs.get("cpu_kernels"),
                                                  engine_kwargs.get("batch_invariant"))
            engine = cls(loaded, tokenizer, name=name, **engine_kwargs)
            if why is not None:
                engine.dtype_choice = why
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
        follow_up: bool = False,
    ) -> Future[Completion]:
        """Queue one question; a bad one gets a future that fails alone, never an exception here.

        `on_text(piece)` streams the answer as it grows, called on one of the engine's delivery
        threads (see `delivery`): in order, all before the future resolves, and a slow callback
        delays only its own request. An exception it raises fails this request alone. Cancelling
        the future stops the request at the next pass and frees what it holds.

        `follow_up`: it comes back after an answer its caller was expected back from (an agent's
        question after its tool ran, `expect_follow_up`); it may wait for its round's others.
        """
        with self._arriving_now():
            return self._enqueue(self._intake.prepare([prompt], [sampling], [adapter]), on_text=[on_text],
                                 follow_up=follow_up)[0]

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
        with self._arriving_now():
            return self._enqueue(self._intake.prepare_many(prompts, sampling, adapters), on_text=on_text)

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
        self._worker.refuse_blocking("stream", self._delivery)
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
        return self._answer("prompt_logits", prompts, None, adapters, all_logits=True)

    def prompt_logprobs(self, prompts: Sequence[Prompt], adapters: AdapterArg | Sequence[AdapterArg] = None,
                        top_logprobs: int = 0) -> list[PromptLogprobs]:
        """Each prompt's tokens with their logprobs given the tokens before them, and up to
        `top_logprobs` (0..20) alternatives each (vLLM's `prompt_logprobs`; what OpenAI's `echo`
        and lm-eval's loglikelihood read), from `prompt_logits`: batch-invariant where the engine is."""
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or \
                not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs={top_logprobs!r} is not allowed; use an integer in "
                                      f"[0, {MAX_TOP_LOGPROBS}]")
        ids = [self.encode(p) for p in prompts]
        return [logprobs.prompt(rows, token_ids, top_logprobs, self._token_texts)
                for rows, token_ids in zip(self.prompt_logits(prompts, adapters), ids)]

    def stats(self) -> dict[str, Any]:
        """Counters since start (requests; passes — `prefill_passes`, those with prompt tokens, and
        `decode_steps`, those of decode rows alone, add up to `forward_passes`; tokens, prefix
        hits), the KV memory now, how this engine computes (its dtype, and whether packed equals
        alone bit for bit; its weights — `weights`: "dense", or a GGUF's blocks "as stored (...)",
        `weights_choice` why, `weight_bytes` the memory they take), its pass target, and two
        latency histograms (`latency.Histogram.snapshot`):
        each pass's duration (`pass_seconds`) and each request's wait from submission to its first
        pass (`queue_seconds`)."""
        with self._cond:
            return {
                **self._scheduler.stats,
                **self._stepper.stats,
                "generated_tokens": self._outputs.generated_tokens,
                "kv_cache_peak_bytes": self._scheduler.peak_blocks * self._kv.block_bytes,
                "dtype": str(self.dtype).removeprefix("torch."),
                "dtype_choice": self.dtype_choice,
                "weights": getattr(self.model, "weights", "dense"),
                "weights_choice": getattr(self.model, "weights_choice", None),
                "weight_bytes": self._weight_bytes,
                "batch_invariant": self._platform.batch_invariant,
                "model_impl": self.model_impl,
                "speculative": self.speculative,
                "draft_model": None if self._draft is None else self._draft.name,
                "draft_seconds": 0.0 if self._draft is None else self._draft.seconds,
                "threads": self.threads,
                "pass_time_ms": self.pass_time_ms if math.isfinite(self.pass_time_ms) else None,  # None: no bound
                "pass_seconds": self._stepper.pass_seconds.snapshot(),
                "queue_seconds": self._scheduler.queue_seconds.snapshot(),
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
        """Whether every answer is bitwise the same packed as alone (see `platforms.invariance`)."""
        return self._platform.batch_invariant

    @property
    def attention(self) -> str:
        """The attention every row of a pass runs on, prefill and decode (`platforms`): "exact" (the
        batch-invariant CPU kernel), "varlen", "triton" or "flash-attn" (the CUDA kernels), "fast"
        (Kev's CPU decode kernel, SDPA for prefill) or "torch"."""
        return self._backend.name

    @property
    def platform(self) -> str:
        """Where this engine computes: "cpu", "cuda", or the device type torch's ops run on."""
        return self._platform.name

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode passes replay CUDA graphs (see `platforms.cuda.graphs`)."""
        return self._runner.graphs is not None

    @property
    def adapters(self) -> list[str]:
        """Names of the LoRA adapters requests may use."""
        with self._cond:
            return self._adapters.names

    def load_adapter(self, name: str, path: str) -> None:
        """Hot-load a PEFT LoRA adapter; running requests are not disturbed.

        `name`: 1 to 64 letters, digits, '.', '_' or '-' (it becomes a model id and a URL path
        segment in `kev serve`), never the engine's own `name`.
        Loading the same name from the same folder again is a no-op (integration objects sharing
        an engine each declare their adapters); the same name from another folder is an error.
        A reload (unload, then load) is a new adapter: no KV computed under the old one is reused.
        """
        check_adapter_name(name, reserved=(self.name,))
        with self._cond:
            if self._adapters.loaded_from(name, path):
                return
        # disk + validation, outside every lock, on a thread that ends (no OpenMP team left here)
        adapter = run_on_passing_thread(lambda: self._adapters.read(name, path), "kev-load-adapter")
        with self._runner.lock, self._cond:
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
        self._worker.refuse_blocking("wait_for_unload", self._delivery)  # it would wait for the requests it blocks
        with self._cond:  # every finished request notifies the condition (`Stepper`)
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

    @property
    def closed(self) -> bool:
        """True once `close()` ran — or when construction failed, leaving nothing to use (so the
        model it claimed can be given to another engine)."""
        worker: Worker | None = getattr(self, "_worker", None)
        return worker is None or worker.stopping

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Start no new pass while inside: everything submitted meanwhile shares the next pass.

        Coalescing without a clock: tests (and callers that know a burst is coming) submit under
        `hold()` and the pack is formed when the block exits. A pass already running finishes,
        and the passes it lets run between its slices (`stepper`) may take what was submitted.
        """
        with self._worker.hold():
            yield

    def arriving(self) -> Arrival:
        """Announce a request that is on its way: an idle engine's first pass waits for it until
        `Arrival.end()` (or leaving its `with`), at most `arrivals.ANNOUNCED_MAX_S`.

        For callers that know of a request before they can submit it (a server, as a request's
        headers arrive): a burst of them then shares one pass instead of starting with the first.
        `submit` announces itself already while it tokenizes, and an async caller's submit counts
        as arriving until its event loop's next turn (see `arrivals`).
        """
        with self._cond:
            return Arrival(self._arrivals.announce(), self._end_arrival)

    def expect_follow_up(self, future: Future[Any]) -> Arrival:
        """Say that `future`'s caller will soon submit again after it is answered — an agent whose
        reply calls a tool asks again once the tool ran — so that the round's follow-ups share a
        pass: while other follow-ups of the round are still expected (their requests running, or
        answered and on their way back), a follow-up that came waits for them (at most
        `arrivals.FOLLOW_UP_WAIT_S`; decodes go on; nobody else waits). `end()` the handle when no
        follow-up will come (the answer called no tool); after the answer it is waited for
        `arrivals.FOLLOW_UP_GRACE_S` at most. The follow-up is a `submit(..., follow_up=True)`.
        """
        with self._cond:
            request = next((r for r in self._scheduler.waiting if r.future is future), None)
            token = self._arrivals.expect(lambda: request is not None and request.status is Status.WAITING)
        handle = Arrival(token, self._unexpect)

        def answered(_: Future[Any]) -> None:
            with self._cond:
                self._arrivals.answered(token)
        future.add_done_callback(answered)
        return handle

    def _unexpect(self, token: int) -> None:
        with self._cond:
            self._arrivals.unexpect(token)
            self._cond.notify_all()

    def _end_arrival(self, token: int) -> None:
        with self._cond:
            self._arrivals.end(token)
            self._cond.notify_all()

    @contextlib.contextmanager
    def _arriving_now(self) -> Iterator[None]:
        """A submit is arriving while it runs; on an event loop's thread until the loop's next turn,
        so that every task submitting in this turn (an `asyncio.gather`) shares the first pass."""
        arrival = self.arriving()
        try:
            yield
        finally:
            loop = running_loop()
            if loop is None:
                arrival.end()
            else:
                loop.call_soon(arrival.end)

    def close(self, timeout: float | None = None) -> None:
        """Stop the scheduler thread; requests still queued or running fail with EngineClosedError.
        The model is given back as it came (its own attention, no LoRA wrappers).

        `timeout` bounds the wait for a pass in progress (None: wait for it); if it passes, the
        thread (stuck in a model hook, say) is left to end on its own and the model is not touched.
        Callbacks still being delivered run on after it returns.
        """
        with self._cond:
            if self._given_back:
                return
            self._worker.stop()
        if not self._worker.join(timeout):
            return
        with self._runner.lock, self._cond:
            if self._given_back:  # another close() finished meanwhile
                return
            self._stepper.drain()
            self._adapters.restore_model()
            if self.model_impl == "transformers":
                release_model(self.model)
                platforms.uninstall(self.model)
            self._given_back = True
        self._delivery.close()
        if self._draft is not None:
            self._draft.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the flow ---------------------------------------------------------------------------

    def step(self) -> int:
        """One pass: plan → run → sample → record → deliver (`stepper`).

        Returns the number of tokens it ran (0: nothing could run). Passes never overlap: a caller
        stepping by hand (inside `hold()`) waits for the scheduler thread's pass to end.
        """
        return self._worker.run_pass(self._stepper.step)

    def has_work(self) -> bool:
        """Anything queued or running: what a caller stepping by hand inside `hold()` steps until."""
        with self._cond:
            return self._stepper.has_work()

    # ---- requests in ------------------------------------------------------------------------

    def _enqueue(
        self,
        prepared: Sequence[Prepared],
        on_text: Sequence[Callable[[str], None] | None] | None = None,
        all_logits: bool = False,
        capture_logits: bool = False,
        follow_up: bool = False,
    ) -> list[Future[Any]]:
        """Queue all valid requests as one group; a refused one gets an already-failed future."""
        with self._cond:
            if self._worker.stopping:
                raise EngineClosedError("the engine is closed")
            follow_up = self._arrivals.arrived(follow_up)
            futures = fanout.futures(self._scheduler.submit(prepared, self._defaults, on_text, all_logits,
                                                            capture_logits, follow_up))
            self._worker.start()
            self._cond.notify_all()
        return futures

    def _answer(self, what: str, prompts: Sequence[Prompt], sampling: Any, adapters: Any,
                return_exceptions: bool = False, capture_logits: bool = False, all_logits: bool = False) -> list[Any]:
        """The blocking calls' one path: prepare every prompt, queue them as one group, wait for all.
        Without `return_exceptions` a refused prompt raises before anything is queued."""
        self._worker.refuse_blocking(what, self._delivery)
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
        queued = self._enqueue(prepared, capture_logits=capture_logits, all_logits=all_logits)
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


def _check_engine_kwargs(cls: type[Engine], engine_kwargs: dict[str, Any]) -> None:
    """Refuse, before the load, what `Engine(...)` would refuse after it: a keyword it lacks, or one
    that `from_pretrained` fills in itself from what it loads (otherwise "multiple values")."""
    for key in ("tokenizer", "name"):
        if key in engine_kwargs:
            raise TypeError(f"from_pretrained() sets {key}= itself from the model it loads; to choose it, "
                            f"build Engine(model, tokenizer, name=...) from transformers objects")
    parameters = inspect.signature(cls.__init__).parameters.values()
    settings = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.name != "name"]
    unknown = sorted(set(engine_kwargs) - set(settings))
    if unknown:
        raise TypeError(f"from_pretrained() got unexpected keyword argument(s) {unknown}; it takes model, device, "
                        f"dtype, trust_remote_code, adapters and Engine's settings {settings}")
    drafts.speculative_mode(engine_kwargs.get("speculative"), batch_invariant=True,  # a bad mode, before the load
                            draft_model=engine_kwargs.get("draft_model") is not None)


def _embedding_rows(model: Any) -> int:
    """How many token ids the model can read (its embedding's rows)."""
    if isinstance(model, models.DecoderModel):
        embed = model.embed
        return int(embed.out_features if isinstance(embed, QuantWeight) else embed.shape[0])
    return int(model.get_input_embeddings().num_embeddings)


def _logits_width(model: Any) -> int:
    """How many logits the model emits per position (its lm_head rows; may exceed the tokenizer)."""
    if isinstance(model, models.DecoderModel):
        return model.head.out_features
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.config.vocab_size)


EXIT_JOIN_S = 10.0  # at interpreter exit, a thread stuck in a pass (a model hook, say) is left behind
_live: weakref.WeakSet[Engine] = weakref.WeakSet()  # every engine not yet collected


@atexit.register
def _close_live() -> None:
    """Stop every live engine's worker before the interpreter tears down torch's thread pools."""
    for engine in list(_live):
        engine.close(timeout=EXIT_JOIN_S)

def _wake_if_cancelled(cond: threading.Condition, future: Future) -> None:
    """A caller cancelled: wake the worker so the request frees what it holds now."""
    if future.cancelled():
        with cond:
            cond.notify_all()
