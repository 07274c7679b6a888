"""`kev`: the engine from a shell. Questions in (arguments or JSONL), one JSON answer per line out.

    kev generate "What is 2+2?" "Name a prime." --max-tokens 32
    kev generate --file questions.jsonl > answers.jsonl      # `--file -` reads stdin
    kev generate --adapter sql=./adapters/sql --file questions.jsonl
    kev generate "List the tables." --adapter sql=./adapters/sql --use-adapter sql
    kev show-pack "first question" "second question" --out pack.png
    kev show-pack --file examples/data/doc_qa.jsonl --out pack.png   # shared prefixes, ids, adapters
    kev verify --model DIR --file prompts.jsonl [--adapter NAME=PATH]   # packed == solo, exit 1 if not
    kev build-kernel     # build Kev's CPU kernels now (once per Python environment; make setup does)

The installed `kev` command is these commands plus `kev serve`, which the integrations package
adds through `Command` (the engine imports nothing of it).

A thin layer: each line becomes chat messages and a `SamplingParams`, then ONE
`engine.generate(...)` call answers them all. A refused question becomes an error row;
the others are still answered. Exit status: 0 all answered, 1 some refused, 2 usage error.

LoRA adapters: `--adapter NAME=PATH` (repeatable) loads a PEFT adapter folder under NAME.
A JSONL line picks one with `"adapter": "NAME"` (`null`: the base model); `--use-adapter NAME`
is the adapter of every question that does not name its own — the only way to give one to
questions passed as arguments. Without either, questions use the base model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TextIO

from ..engine import Engine
from ..errors import InvalidRequestError
from ..inputs.params import SamplingParams
from ..platforms.cpu import kernels
from .verify import verify
from .visualize import draw_pack_mask, format_table

SAMPLING_KEYS = [f.name for f in fields(SamplingParams)]
QUESTION_KEYS = ["id", "question", "context", "messages", "adapter"]


@dataclass(frozen=True)
class Command:
    """A subcommand from outside the engine (`kev serve`): its arguments, and what runs it."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class UsageError(ValueError):
    """Bad input to the command itself (exit status 2), as opposed to one refused question."""


def read_jsonl(stream: TextIO, name: str) -> list[dict[str, Any]]:
    """Parse one JSON object per non-blank line; a bad line is named by its number."""
    records = []
    for number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{name} line {number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise UsageError(f"{name} line {number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def read_questions(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Questions from the arguments first, then from --file; each gets an id (its position by default)."""
    records: list[dict[str, Any]] = [{"question": q} for q in args.questions]
    if args.file == "-":
        records += read_jsonl(sys.stdin, "<stdin>")
    elif args.file:
        try:
            with open(args.file, encoding="utf-8") as stream:
                records += read_jsonl(stream, args.file)
        except OSError as exc:
            raise UsageError(f"cannot read --file {args.file!r}: {exc.strerror}") from None
    if not records:
        raise UsageError("no questions; give some as arguments or with --file")
    return [{"id": i, **record} for i, record in enumerate(records)]


def build_prompt(record: dict[str, Any], system: str | None, raw: bool) -> Any:
    """One record → chat messages (or plain text with --raw); a bad record raises InvalidRequestError."""
    unknown = sorted(set(record) - set(QUESTION_KEYS) - set(SAMPLING_KEYS))
    if unknown:
        raise InvalidRequestError(f"unknown key(s) {unknown}; allowed: {QUESTION_KEYS + SAMPLING_KEYS}")
    if "messages" in record:
        if raw:
            raise InvalidRequestError("--raw sends plain text; this question gives 'messages'")
        return record["messages"]
    question, context = record.get("question"), record.get("context")
    if not isinstance(question, str):
        raise InvalidRequestError(f"question={question!r} is not allowed; give a string (or 'messages')")
    if context is not None and not isinstance(context, str):
        raise InvalidRequestError(f"context of type {type(context).__name__} is not allowed; give a string")
    content = f"Context:\n{context}\n\nQuestion: {question}" if context else question
    if raw:
        return f"{system}\n\n{content}" if system else content
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]


def parse_adapters(args: argparse.Namespace) -> dict[str, str]:
    """`--adapter NAME=PATH` flags → {name: folder}; checked before the slow model load."""
    adapters: dict[str, str] = {}
    for spec in getattr(args, "adapter_specs", None) or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--adapter {spec!r} is not NAME=PATH (e.g. --adapter sql=./adapters/sql)")
        if name in adapters:
            raise UsageError(f"--adapter names {name!r} twice ({adapters[name]!r} and {path!r})")
        if not Path(path).expanduser().is_dir():
            raise UsageError(f"--adapter {spec!r}: folder {path!r} does not exist")
        adapters[name] = path
    default = getattr(args, "use_adapter", None)
    if default is not None and default not in adapters:
        raise UsageError(f"--use-adapter {default!r} is not loaded; give it with --adapter {default}=PATH "
                         f"(loaded: {sorted(adapters)})")
    return adapters


def _sampling_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags given on the command line; each question's own keys override them."""
    flags = {key: getattr(args, key, None) for key in SAMPLING_KEYS if getattr(args, key, None) is not None}
    try:
        SamplingParams.from_dict(flags)
    except InvalidRequestError as exc:
        raise UsageError(str(exc)) from None
    return flags


def run_generate(engine: Engine, args: argparse.Namespace, records: list[dict[str, Any]]) -> int:
    flags = _sampling_flags(args)
    rows: list[dict[str, Any] | None] = []  # None: to be answered by the engine
    prompts, samplings, adapters = [], [], []
    for record in records:
        try:
            prompt = build_prompt(record, args.system, args.raw)
            sampling = SamplingParams.from_dict({**flags, **{k: record[k] for k in SAMPLING_KEYS if k in record}})
        except InvalidRequestError as exc:
            rows.append({"id": record["id"], "error": str(exc)})
            continue
        rows.append(None)
        prompts.append(prompt)
        samplings.append(sampling)
        adapters.append(record.get("adapter", args.use_adapter))  # the engine refuses an unknown name
    started = time.perf_counter()
    results = iter(engine.generate(prompts, sampling=samplings, adapters=adapters, return_exceptions=True))
    wall = time.perf_counter() - started
    failed = 0
    for record, row in zip(records, rows):
        if row is None:
            result = next(results)
            if isinstance(result, BaseException):
                row = {"id": record["id"], "error": str(result) or type(result).__name__}
            else:
                row = {"id": record["id"], "text": result.text, "finish_reason": result.finish_reason,
                       "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens}
        failed += "error" in row
        print(json.dumps(row, ensure_ascii=False), flush=True)
    print(f"kev: {len(records) - failed} answered, {failed} failed in {wall:.2f} s; "
          f"stats {json.dumps(engine.stats())}", file=sys.stderr)
    return 1 if failed else 0


def run_verify(engine: Engine, args: argparse.Namespace, records: list[dict[str, Any]]) -> int:
    """Pack the prompts, run each alone, print one row per prompt; exit 1 when any differs."""
    try:
        prompts = [build_prompt(record, args.system, args.raw) for record in records]
        adapters = [record.get("adapter", args.use_adapter) for record in records]
        bitwise = engine.batch_invariant if args.bitwise is None else args.bitwise
        rows = verify(engine, prompts, adapters, args.max_tokens, bitwise=bitwise)
    except (InvalidRequestError, KeyError) as exc:
        print(f"kev: error: {exc}", file=sys.stderr)
        return 2
    for record, row in zip(records, rows):
        print(json.dumps({"id": record["id"], **row}), flush=True)
    bad = [r for r, row in zip(records, rows) if not row["ok"]]
    print(f"kev verify: {len(rows) - len(bad)}/{len(rows)} prompts packed == solo, "
          f"{'bit for bit' if bitwise else 'within rounding'} "
          f"({sum(row['shared_prefix_tokens'] for row in rows)} prompt tokens read from shared prefixes)"
          + (f"; DIFFERENT: {[r['id'] for r in bad]}" if bad else ""), file=sys.stderr)
    return 1 if bad else 0


def run_show_pack(engine: Engine, args: argparse.Namespace, records: list[dict[str, Any]]) -> int:
    """Draw the pass these questions would share (prefixes included) and print its segment table."""
    prompts, adapters = [], []
    for record in records:
        adapter = record.get("adapter", args.use_adapter)
        try:
            prompts.append(build_prompt(record, args.system, args.raw))
            if adapter is not None and adapter not in engine.adapters:
                raise InvalidRequestError(f"unknown adapter {adapter!r}; loaded: {engine.adapters}")
        except InvalidRequestError as exc:
            print(f"kev: question {record['id']!r}: {exc}", file=sys.stderr)
            return 1
        adapters.append(adapter)
    try:
        rows = draw_pack_mask(engine, prompts, args.out, adapters=adapters, max_pixels=args.max_pixels,
                              ids=[record["id"] for record in records])
    except InvalidRequestError as exc:  # a prompt the engine refuses (empty, too long)
        print(f"kev: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kev: error: cannot write --out {args.out!r}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    print(f"kev: drew {len(rows)} segments, {rows[-1]['end']} tokens computed, "
          f"{sum(row['shared_prefix'] for row in rows)} read from shared prefixes, to {args.out}", file=sys.stderr)
    return 0


def run_build_kernel() -> int:
    """Build (or find already built) Kev's CPU kernels; 1 with the reason if they cannot be."""
    try:
        built = kernels.load_kernels()
    except RuntimeError as exc:
        print(f"kev: error: {exc}", file=sys.stderr)
        return 1
    names = ", ".join(kernels.build_name(build) for build in kernels.BUILDS)
    print(f"kev: Kev's CPU kernels are built ({names} in {kernels.build_root()}; {built.linear_paths})",
          file=sys.stderr)
    return 0


def run_quantize(args: argparse.Namespace) -> int:
    """Write args.folder as a GGUF of args.kind blocks; 2 with the reason if it cannot."""
    from .quantize import quantize

    try:
        out = quantize(args.folder, args.out, args.kind)
    except (ValueError, OSError) as exc:
        print(f"kev: error: {exc}", file=sys.stderr)
        return 2
    print(f"kev: wrote {out} ({args.kind}, {out.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose and load the model, the same on `kev generate` and `kev serve`."""
    parser.add_argument("--model", help="local folder, .gguf file or hub id (default: embedded SmolLM2-135M)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1... (default: cuda if available)")
    parser.add_argument("--dtype", help="auto, float32, bfloat16, float16 (default auto: bf16 on CUDA, and on CPUs "
                        "where bf16 measures faster than fp32; else fp32)")
    parser.add_argument("--max-model-len", dest="max_model_len", type=int, metavar="TOKENS",
                        help="longest question (prompt + answer) in tokens, at most the model's context (default: "
                        "the model's); a model with a narrower sliding window loads only with this at most the window")
    parser.add_argument("--weights", choices=("auto", "as-stored", "dense"),
                        help="a GGUF's quantized weights: as-stored (computed in place by Kev's CPU kernels: the "
                        "file's size in memory, the same answers), dense (dequantized into --dtype), auto (default: "
                        "what measured faster for batches: dense where that takes at most half the memory available, "
                        "else as stored; one question at a time runs faster as-stored)")
    parser.add_argument("--model-impl", dest="model_impl", choices=("auto", "kev", "transformers"),
                        help="the model's implementation: auto (default: Kev's own forward for the Llama, Mistral, "
                        "Qwen2 and Qwen3 families, else transformers' modeling code), kev, transformers")
    parser.add_argument("--speculative", choices=("auto", "ngram", "model", "off"),
                        help="speculative decoding: auto (default: KEV_SPECULATIVE, else auto = model with "
                        "--draft-model, else ngram, where the engine is batch-invariant), ngram (drafts from each "
                        "question's own text, verified in the packed pass: the same tokens as off, bit for bit), "
                        "model (drafts written by --draft-model), off")
    parser.add_argument("--draft-model", dest="draft_model", metavar="MODEL",
                        help="a smaller model with the same tokenizer that drafts (a folder, .gguf file or hub id; "
                        "with --speculative model or auto)")


def build_parser(extra: Sequence[Command] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kev", description="Answer many questions in one packed pass.")
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("questions", nargs="*", metavar="QUESTION", help="questions to ask")
    common.add_argument(
        "--file", help='JSONL, one {"question", "context"?, "id"?, sampling keys?} or {"messages"} a line; - = stdin'
    )
    add_model_arguments(common)
    common.add_argument("--system", help="system message put before every question")
    common.add_argument("--raw", action="store_true", help="send plain text, not chat messages")
    gen = commands.add_parser("generate", parents=[common], help="answer questions, one JSON line each")
    gen.add_argument("--max-tokens", dest="max_tokens", type=int, help="most new tokens per answer (default 256)")
    gen.add_argument("--temperature", type=float, help="0 = greedy (default: KEV_TEMPERATURE, else 0)")
    gen.add_argument("--top-p", dest="top_p", type=float, help="nucleus mass in (0, 1] (default 1 = off)")
    gen.add_argument("--top-k", dest="top_k", type=int, help="keep the k likeliest tokens (default 0 = off)")
    gen.add_argument("--seed", type=int, help="seeded sampling: same tokens whatever the pack")
    gen.add_argument("--stop", action="append", metavar="STR", help="a string that ends an answer (repeatable)")
    gen.add_argument("--cache-salt", dest="cache_salt", metavar="SALT",
                     help="questions with different salts never share prefix KV (one per tenant)")
    verify = commands.add_parser("verify", parents=[common],
                                 help="check packed == solo on your own model and prompts (exit 1 if not)")
    verify.add_argument("--max-tokens", dest="max_tokens", type=int, default=16,
                        help="greedy tokens compared per prompt (default 16)")
    verify.add_argument("--bitwise", dest="bitwise", action=argparse.BooleanOptionalAction, default=None,
                        help="logits must be bitwise equal (default: yes where the engine is batch-invariant, "
                             "else within rounding)")
    show = commands.add_parser("show-pack", parents=[common], help="draw the pack's attention mask as a PNG")
    show.add_argument("--out", required=True, help="PNG file to write")
    show.add_argument("--max-pixels", dest="max_pixels", type=int, default=1024, help="most mask pixels per side")
    commands.add_parser("build-kernel", help="build Kev's CPU kernels now (make setup does)")
    quantize = commands.add_parser("quantize", help="write a transformers folder as a GGUF of quantized blocks")
    quantize.add_argument("folder", help="the model folder (config.json, *.safetensors, tokenizer)")
    quantize.add_argument("out", help="the .gguf file to write")
    quantize.add_argument("--type", dest="kind", default="Q8_0", help="Q8_0 (default), Q4_0, Q4_1, Q5_0 or Q5_1")
    for command in extra:
        command.add_arguments(commands.add_parser(command.name, help=command.help))
    for sub in (gen, verify, show):
        sub.add_argument("--adapter", dest="adapter_specs", action="append", metavar="NAME=PATH",
                         help='load a PEFT LoRA folder as NAME (repeatable); a JSONL line uses it with "adapter"')
        sub.add_argument("--use-adapter", dest="use_adapter", metavar="NAME",
                         help="adapter for questions that name none (default: the base model)")
    return parser


def main(argv: Sequence[str] | None = None, extra: Sequence[Command] = ()) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["serve"] and not any(command.name == "serve" for command in extra):
        print("kev: error: serve is not an engine command; run the installed `kev serve` (needs kev-llm[server])",
              file=sys.stderr)
        return 2
    parser = build_parser(extra)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): report it as the return value
        return exc.code if isinstance(exc.code, int) else 2
    for command in extra:
        if args.command == command.name:
            return command.run(args)
    if args.command == "build-kernel":
        return run_build_kernel()
    if args.command == "quantize":
        return run_quantize(args)
    try:
        records = read_questions(args)
        if args.command == "generate":
            _sampling_flags(args)  # refuse bad flags before the slow model load
        elif args.command == "verify":
            if args.max_tokens < 1:
                raise UsageError(f"--max-tokens={args.max_tokens} is not allowed; use an integer >= 1")
        elif args.max_pixels < 16:
            raise UsageError(f"--max-pixels={args.max_pixels} is too small; use at least 16")
        adapters = parse_adapters(args)
        engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                        max_model_len=args.max_model_len, model_impl=args.model_impl,
                                        speculative=args.speculative, weights=args.weights,
                                        draft_model=args.draft_model)
    except (UsageError, ValueError, OSError) as exc:
        print(f"kev: error: {exc}", file=sys.stderr)
        return 2
    print(f"kev: {engine.name} on {engine.device} in {engine.stats()['dtype']}, "
          f"{'batch-invariant' if engine.batch_invariant else 'not batch-invariant'}", file=sys.stderr)
    with engine:
        try:
            for name, path in adapters.items():
                engine.load_adapter(name, path)
        except ValueError as exc:  # AdapterError: a folder that is not a LoRA for this model
            print(f"kev: error: {exc}", file=sys.stderr)
            return 2
        if args.command == "generate":
            return run_generate(engine, args, records)
        if args.command == "verify":
            return run_verify(engine, args, records)
        return run_show_pack(engine, args, records)
