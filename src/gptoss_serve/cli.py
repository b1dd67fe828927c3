"""The command line: the only place that reads argv and the environment.

gptoss-serve generate --model DIR|demo --prompt TEXT ...
gptoss-serve logits --model DIR|demo --prompt-ids 1,2,3|@FILE --out FILE.npy
gptoss-serve make-checkpoint OUT --preset tiny|20b|120b [--layers N ...]
gptoss-serve bench-serve --base-url URL --concurrency N --input-len N --output-len N ...
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime as dt
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import uvicorn

from gptoss_serve.benchmarks import report, serve_load
from gptoss_serve.benchmarks.engine_run import (
    cap_process_memory,
    fit_check_subprocess,
    run_engine_bench,
    run_fit_check,
    write_results,
)
from gptoss_serve.checkpoint import CheckpointError
from gptoss_serve.checkpoint.demo import resolve_model_dir
from gptoss_serve.checkpoint.presets import OVERRIDE_FIELDS
from gptoss_serve.checkpoint.synthetic import make_checkpoint
from gptoss_serve.config import (
    KV_CACHE_DTYPES,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    ServerConfig,
    check_model_id,
)
from gptoss_serve.constrain.grammar import ConstraintSpec, build_grammar
from gptoss_serve.engine import seats
from gptoss_serve.engine.allocator import configure_allocator
from gptoss_serve.engine.constrained import GrammarConstraint
from gptoss_serve.engine.cpu_engine import CpuEngine
from gptoss_serve.engine.startup import build_async_engine
from gptoss_serve.engine.synthetic_weights import (
    SYNTHETIC_MODELS,
    synthetic_model_config,
    synthetic_weights,
)
from gptoss_serve.engine.weights import ModelWeights, load_weights
from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.conversation import Message, MessageDone, MessageStarted, RenderRequest
from gptoss_serve.harmony.parse import HarmonyStreamParser
from gptoss_serve.harmony.render import render_prompt
from gptoss_serve.kernels.kv_dtype import cache_dtype
from gptoss_serve.model import load_model
from gptoss_serve.model.generate import SamplingParams, generate
from gptoss_serve.model.transformer import SUPPORTED_DTYPES
from gptoss_serve.server.api_keys import API_KEY_ENV, check_api_key
from gptoss_serve.server.app import create_app
from gptoss_serve.server.cors import check_origin
from gptoss_serve.server.store import ResponseStore

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")


class UsageError(Exception):
    """A bad command line or input file: reported in one line, exit status 2."""


def cache_dir() -> Path:
    """Where the demo checkpoint lives: $XDG_CACHE_HOME, else ~/.cache."""
    base = os.environ.get("XDG_CACHE_HOME")
    return Path(base) if base else Path.home() / ".cache"


def data_dir() -> Path:
    """Where stored responses live by default: $XDG_DATA_HOME, else ~/.local/share."""
    base = os.environ.get("XDG_DATA_HOME")
    return (Path(base) if base else Path.home() / ".local" / "share") / "gptoss-serve"


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory, or 'demo'")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="float32 (CPU engine default), bfloat16 (GPU)")  # fmt: skip
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")


def _load(args: argparse.Namespace):

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model_dir = resolve_model_dir(args.model, cache_dir())
    except FileNotFoundError as error:
        raise UsageError(str(error)) from error
    started = time.perf_counter()
    dtype = SUPPORTED_DTYPES[args.dtype or "float32"]
    model = load_model(model_dir, dtype=dtype, device=device)
    logger.info("model ready in %.1fs", time.perf_counter() - started)
    return model


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seats(text: str) -> int | None:
    """``--max-num-seqs``: a count, or "auto" (None): as many as the GPU holds (engine/seats)."""
    if text == "auto":
        return None
    try:
        return _positive_int(text)
    except ValueError:
        message = f"must be a positive integer or auto, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _add_access_args(serve: argparse.ArgumentParser) -> None:
    """Who may reach the server and how: TLS, API keys, CORS origins, the model's ids."""
    serve.add_argument("--ssl-certfile", type=Path, default=None,
                       help="serve HTTPS with this PEM certificate (and its key)")  # fmt: skip
    serve.add_argument("--ssl-keyfile", type=Path, default=None,
                       help="the certificate's PEM private key")  # fmt: skip
    serve.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on the /v1 routes (repeat for "
                       f"several keys; or set {API_KEY_ENV}); /health and /metrics stay "
                       "open")  # fmt: skip
    serve.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                       help="browser origins (scheme://host[:port], or '*') answered with CORS "
                       "headers (default: none)")  # fmt: skip
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the ids requests name the model by (the first is the one responses "
                       "carry; default: 'demo', or the checkpoint directory's name)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gptoss-serve", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING ...")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="render a Harmony chat and stream the answer")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--instructions", default=None, help="developer message")
    gen.add_argument("--reasoning-effort", choices=("low", "medium", "high"), default="medium")
    gen.add_argument("--max-tokens", type=_positive_int, default=256)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--show-analysis", action="store_true", help="also print the reasoning")
    gen.add_argument("--reasoning-budget", type=_non_negative_int, default=None,
                     help="most analysis tokens (default: the server's for the effort, capped "
                     "at half of --max-tokens)")  # fmt: skip

    logits = commands.add_parser("logits", help="write float32 logits [T, vocab] of one pass")
    _add_model_args(logits)
    logits.add_argument("--prompt-ids", required=True, help="1,2,3 or @FILE (ids, any spacing)")
    logits.add_argument("--out", required=True, type=Path, help="output .npy file")

    serve = commands.add_parser("serve", help="serve the OpenAI Responses API over HTTP")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--store-path", type=Path, default=None,
                       help="SQLite file of stored responses (default: XDG data dir)")  # fmt: skip
    serve.add_argument("--store-retention-days", type=_non_negative_float, default=30.0,
                       help="stored responses are deleted this many days after they were made "
                       "(default 30, as the official API keeps them; 0: never)")  # fmt: skip
    serve.add_argument("--default-max-output-tokens", type=_positive_int, default=4096,
                       help="output cap for requests without max_output_tokens")  # fmt: skip
    serve.add_argument("--max-request-mb", type=_positive_int,
                       default=ServerConfig.max_request_bytes // 2**20,
                       help="largest request body in MiB (larger: 413)")  # fmt: skip
    serve.add_argument("--render-processes", type=_non_negative_int,
                       default=ServerConfig.render_processes,
                       help="worker processes that render large prompts off the event loop "
                       "(0: in the server's process)")  # fmt: skip
    serve.add_argument("--replay-cache-tokens", type=_non_negative_int,
                       default=ServerConfig.replay_cache_tokens,
                       help="generated tokens of recent assistant messages kept, so that a "
                       "prompt sending them back gets them as the model generated them and "
                       "the prefix cache reaches past a tool loop's calls (0: off)")  # fmt: skip
    _add_access_args(serve)
    serve.add_argument("--max-concurrent", type=_positive_int, default=8,
                       help="requests decoded in turn at once; more wait in a queue")  # fmt: skip
    serve.add_argument("--engine", choices=("auto", "gpu", "cpu"), default="auto",
                       help="gpu: the batched paged-KV engine (default when CUDA is present); "
                       "cpu: the plain-torch one")  # fmt: skip
    _add_engine_args(serve)
    defaults = ServerConfig()
    for effort in ("low", "medium", "high"):
        serve.add_argument(f"--reasoning-budget-{effort}", type=_non_negative_int,
                           default=defaults.reasoning_budget(effort),
                           help=f"most analysis tokens at reasoning effort {effort} (a request's "
                           "reasoning_budget overrides it)")  # fmt: skip

    bench = commands.add_parser("bench", help="benchmark the GPU engine offline (no HTTP)")
    bench.add_argument("--model", default="synthetic-120b",
                       help="synthetic-120b, synthetic-20b or a checkpoint directory")  # fmt: skip
    _add_engine_args(bench)
    bench.add_argument("--out", type=Path, default=Path("bench/results/engine.json"))
    bench.add_argument("--decode-tokens", type=_positive_int, default=256,
                       help="tokens decoded per sequence in the decode figures")  # fmt: skip
    bench.add_argument("--throughput-seqs", type=_positive_int, default=1024,
                       help="most sequences of the max-throughput figure (1k in / 1k out): as "
                       "many as the KV cache holds at 2k tokens each, up to this (default: the "
                       "largest CUDA-graph batch, 1024)")  # fmt: skip
    bench.add_argument("--skip-fit-check", action="store_true",
                       help="skip the 128k-context-in-80-GB check (a second process)")  # fmt: skip
    bench.add_argument("--fit-check-only", action="store_true", help=argparse.SUPPRESS)

    make = commands.add_parser("make-checkpoint", help="write a random-weight checkpoint")
    make.add_argument("out", type=Path)
    make.add_argument("--preset", choices=("tiny", "20b", "120b"), default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--shards", type=_positive_int, default=1)
    for flag in ("layers", "experts", "experts-per-token", "hidden", "intermediate", "heads",
                 "kv-heads", "head-dim", "vocab", "sliding-window"):  # fmt: skip
        make.add_argument(f"--{flag}", type=_positive_int, default=None)

    _add_bench_serve_parser(commands)
    return parser


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The GPU engine's sizing flags (serve and bench)."""
    defaults = SchedulerConfig()
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of the GPU this process may hold (default 0.9)",
    )
    parser.add_argument(
        "--max-gpu-memory",
        type=float,
        default=None,
        metavar="GB",
        help="GB of GPU memory this process may hold (weights, KV cache, graphs)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=_seats,
        default=None,
        metavar="N|auto",
        help=f"requests running at once (the largest decode batch); auto (the default): as many "
        f"as the KV cache holds at {seats.SEAT_TOKENS} tokens each, {seats.MIN_SEATS} to "
        f"{seats.MAX_SEATS}",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=defaults.max_num_batched_tokens,
        help="tokens in one step",
    )
    parser.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="prompt + output tokens of one request (default: the model's)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="auto: K and V as the model computes them (bf16); fp8: E4M3, twice the tokens in "
        "the same memory, outputs no longer exactly the model's",
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument(
        "--piecewise-max-tokens",
        type=int,
        default=EngineConfig().piecewise_max_tokens,
        help="steps with prefills of up to this many tokens run as piecewise CUDA graphs "
        "(attention eager between them); 0: eagerly",
    )
    parser.add_argument(
        "--no-pdl",
        action="store_true",
        help="plain kernel launches (no programmatic dependent launch)",
    )
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="schedule each step after the last one's tokens are read (no step launched ahead)",
    )


def engine_config(args: argparse.Namespace, *, max_num_seqs: int | None = None) -> EngineConfig:
    """The GPU engine's settings from the flags; ``max_num_seqs`` overrides the flag's count.
    Seats left to "auto" are settled on the device when the engine is built (engine/seats.py)."""
    auto = max_num_seqs is None and args.max_num_seqs is None
    try:
        # An FP8 cache under --dtype float32 is refused here, before minutes of weight loading.
        activations = SUPPORTED_DTYPES[getattr(args, "dtype", None) or "bfloat16"]
        cache_dtype(args.kv_cache_dtype, activations)
        scheduler = SchedulerConfig(
            max_num_seqs=seats.MAX_SEATS if auto else max_num_seqs or args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len or SchedulerConfig().max_model_len,
            enable_prefix_caching=not args.no_prefix_caching,
        )
        return EngineConfig(
            scheduler=scheduler,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_gpu_memory_gb=args.max_gpu_memory,
            use_cuda_graphs=not args.no_cuda_graphs,
            piecewise_max_tokens=args.piecewise_max_tokens,
            programmatic_launch=not args.no_pdl,
            async_scheduling=not args.no_async_scheduling,
            reference_ops=getattr(args, "dtype", None) == "float32",
            kv_cache_dtype=args.kv_cache_dtype,
            fit_max_num_seqs=auto,
        )
    except ValueError as error:
        raise UsageError(str(error)) from error


def _load_weights(model: str, *, dtype: torch.dtype) -> tuple[ModelWeights, str]:
    """The GPU engine's weights: random ones of a real shape, or a checkpoint directory."""
    if not torch.cuda.is_available():
        raise UsageError("the GPU engine needs CUDA (use --engine cpu)")
    started = time.perf_counter()
    name = _model_name(model)
    if model in SYNTHETIC_MODELS:
        weights = synthetic_weights(synthetic_model_config(model), device="cuda", dtype=dtype)
    else:
        try:
            model_dir = resolve_model_dir(model, cache_dir())
        except FileNotFoundError as error:
            raise UsageError(str(error)) from error
        weights = load_weights(model_dir, device="cuda", dtype=dtype, progress=True)
    logger.warning("weights of %s ready in %.1fs (%.2f GB)", name,
                   time.perf_counter() - started, weights.num_bytes() / 1e9)  # fmt: skip
    return weights, name


def parse_token_ids(spec: str) -> list[int]:
    """``1,2,3`` or ``@FILE`` whose text holds ids separated by commas and/or whitespace."""
    if spec.startswith("@"):
        try:
            spec = Path(spec[1:]).read_text()
        except OSError as error:
            raise UsageError(f"--prompt-ids: cannot read {spec[1:]} ({error.strerror})") from error
    parts = spec.replace(",", " ").split()
    if not parts:
        raise UsageError("--prompt-ids: no token ids given")
    try:
        return [int(part) for part in parts]
    except ValueError as error:
        raise UsageError(f"--prompt-ids: not an integer list ({error})") from error


def run_generate(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop_token_ids=adapter.assistant_stop_token_ids(),
        )
    except ValueError as error:
        raise UsageError(str(error)) from error
    model = _load(args)
    prompt_ids = render_prompt(
        RenderRequest(
            items=(Message("user", args.prompt),),
            instructions=args.instructions,
            reasoning_effort=args.reasoning_effort,
        )
    )
    budget = args.reasoning_budget
    if budget is None:
        budget = min(ServerConfig().reasoning_budget(args.reasoning_effort), args.max_tokens // 2)
    # The same well-formed Harmony turn as the server's (free text answer, no tools).
    grammar = build_grammar(ConstraintSpec(reasoning_budget=budget))
    parser = HarmonyStreamParser()
    generated: list[int] = []
    num_messages = 0
    channel = None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        constraint = GrammarConstraint(grammar, pool)  # the first one builds the vocabulary
        started = time.perf_counter()
        for token in generate(model, prompt_ids, params, constraint):
            generated.append(token)
            num_messages, channel = _show(parser.feed(token), num_messages, channel, args)
    elapsed = time.perf_counter() - started
    sys.stdout.write("\n")
    if parser.framing_error is not None:
        sys.stderr.write(f"[Harmony framing error ({parser.framing_error}); raw output: "
                         f"{adapter.decode(generated)!r}]\n")  # fmt: skip
    rate = len(generated) / elapsed if elapsed > 0 else float("inf")
    sys.stderr.write(
        f"[{len(prompt_ids)} prompt tokens, {len(generated)} generated, {num_messages} messages "
        f"complete, {rate:.1f} tok/s]\n"
    )
    return 0


def _show(events: list, num_messages: int, channel: str | None, args: argparse.Namespace):
    """Write a token's parse events: final text to stdout, analysis to stderr if asked."""
    for event in events:
        if isinstance(event, MessageStarted):
            channel = event.channel
        elif isinstance(event, MessageDone):
            num_messages += 1
        elif channel in ("final", None):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif args.show_analysis:
            sys.stderr.write(event.text)
            sys.stderr.flush()
    return num_messages, channel


def run_logits(args: argparse.Namespace) -> int:
    token_ids = parse_token_ids(args.prompt_ids)
    model = _load(args)
    vocab_size = model.config.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise UsageError(
            f"--prompt-ids: token id {bad[0]} outside the vocabulary [0, {vocab_size})"
        )
    if len(token_ids) > model.config.max_position_embeddings:
        raise UsageError(f"--prompt-ids: {len(token_ids)} ids exceed the context length")
    logits = model(torch.tensor(token_ids, dtype=torch.long), model.new_cache())
    np.save(args.out, logits.float().cpu().numpy())
    sys.stderr.write(f"wrote {args.out} {list(logits.shape)} float32\n")
    return 0


def run_make_checkpoint(args: argparse.Namespace) -> int:

    overrides = {key: getattr(args, key) for key in OVERRIDE_FIELDS}
    try:
        out = make_checkpoint(
            args.out, args.preset, seed=args.seed, num_shards=args.shards, **overrides
        )
    except ValueError as error:  # includes ConfigError for impossible shapes
        raise UsageError(str(error)) from error
    sys.stderr.write(f"wrote a random {args.preset} checkpoint to {out}\n")
    return 0


def _checked(flag: str, values: Sequence[str], check: Callable[[str], None]) -> tuple[str, ...]:
    """``values`` in order without repeats, each passed by ``check``, whose ValueError becomes
    a usage error naming ``flag``."""
    for value in values:
        try:
            check(value)
        except ValueError as error:
            raise UsageError(f"{flag}: {error}") from error
    return tuple(dict.fromkeys(values))


def api_keys(flags: list[str] | None, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The keys of ``--api-key`` and of the environment's GPTOSS_SERVE_API_KEY, checked."""
    keys = [*(flags or []), *([environ[API_KEY_ENV]] if environ.get(API_KEY_ENV) else [])]
    return _checked(f"--api-key / {API_KEY_ENV}", keys, check_api_key)


def served_names(names: list[str] | None, model: str) -> tuple[str, ...]:
    """The model's ids: ``--served-model-name``'s, in order, else the one ``--model`` gives."""
    if not names:
        return (_model_name(model),)
    return _checked("--served-model-name", names, check_model_id)


def allowed_origins(origins: list[str] | None) -> tuple[str, ...]:
    """``--allowed-origins``, checked (a path or a missing scheme would never match)."""
    return _checked("--allowed-origins", origins or [], check_origin)


def _retention_s(days: float) -> int:
    """Whole seconds; any positive number of days is at least one (0 alone means never)."""
    return max(1, round(days * 86400)) if days else 0


def _model_name(model: str) -> str:
    """The id a ``--model`` value is served under: ``demo``, a synthetic preset's name, or the
    checkpoint directory's name."""
    if model == "demo" or model in SYNTHETIC_MODELS:
        return model
    return Path(model).resolve().name


def run_serve(args: argparse.Namespace) -> int:
    store_path = args.store_path or data_dir() / "responses.sqlite3"
    keys = api_keys(args.api_key, os.environ)  # before minutes of weight loading
    name, *aliases = served_names(args.served_model_name, args.model)
    origins = allowed_origins(args.allowed_origins)
    tls = tls_options(args.ssl_certfile, args.ssl_keyfile)
    config = ServerConfig(
        host=args.host, port=args.port, store_path=str(store_path),
        store_retention_s=_retention_s(args.store_retention_days),
        default_max_output_tokens=args.default_max_output_tokens,
        reasoning_budget_low=args.reasoning_budget_low,
        reasoning_budget_medium=args.reasoning_budget_medium,
        reasoning_budget_high=args.reasoning_budget_high,
        max_request_bytes=args.max_request_mb * 2**20, render_processes=args.render_processes,
        replay_cache_tokens=args.replay_cache_tokens, api_keys=keys,
        model_aliases=tuple(aliases), allowed_origins=origins,
    )  # fmt: skip
    use_gpu = args.engine == "gpu" or (args.engine == "auto" and torch.cuda.is_available())
    if use_gpu:
        dtype = SUPPORTED_DTYPES[args.dtype or "bfloat16"]
        settings = engine_config(args)  # its usage errors before minutes of weight loading
        weights, _ = _load_weights(args.model, dtype=dtype)
        engine = build_async_engine(weights, name, settings)
    else:
        if args.model in SYNTHETIC_MODELS:
            raise UsageError(f"{args.model} needs the GPU engine")
        if args.kv_cache_dtype != "auto":
            raise UsageError(f"--kv-cache-dtype {args.kv_cache_dtype} needs the GPU engine")
        model = _load(args)
        engine = CpuEngine(model, name, max_active=args.max_concurrent,
                           max_context_tokens=args.max_model_len)  # fmt: skip
    app = create_app(engine, ResponseStore(config.store_path), config)
    access = f"{len(keys)} API key(s) required" if keys else "no API key required"
    scheme = "https" if tls else "http"
    logger.warning("serving %s on %s://%s:%d (store: %s; %s)", ", ".join([name, *aliases]),
                   scheme, args.host, args.port, store_path, access)  # fmt: skip
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level.lower(), **tls)
    return 0


def tls_options(certfile: Path | None, keyfile: Path | None) -> dict[str, str]:
    """uvicorn's TLS arguments: both files, readable, or neither (plain HTTP)."""
    if certfile is None and keyfile is None:
        return {}
    if certfile is None or keyfile is None:
        raise UsageError("--ssl-certfile and --ssl-keyfile go together")
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not path.is_file():
            raise UsageError(f"{flag}: no file {path}")
    return {"ssl_certfile": str(certfile), "ssl_keyfile": str(keyfile)}


def run_bench(args: argparse.Namespace) -> int:
    if args.fit_check_only:  # the capped second process: cap first, then make the weights
        cap_process_memory()
        weights, _ = _load_weights(args.model, dtype=torch.bfloat16)
        return run_fit_check(weights, engine_config(args))
    # The capped process first, while this one holds no GPU memory yet.
    fit = None if args.skip_fit_check else fit_check_subprocess(args.model, args.kv_cache_dtype)
    weights, name = _load_weights(args.model, dtype=torch.bfloat16)
    config = engine_config(args, max_num_seqs=max(args.max_num_seqs or 1, args.throughput_seqs))
    commit = os.environ.get("BENCH_COMMIT") or report.git_commit()
    results = run_engine_bench(weights, name, config, decode_tokens=args.decode_tokens,
                               throughput_seqs=args.throughput_seqs, commit=commit)  # fmt: skip
    write_results(results, fit, args.out)
    return 0


def _add_bench_serve_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench-serve",
        help="load a running server with /v1/responses (or chat) requests; print timings",
    )
    # Numbers are checked by BenchServeConfig, so that a bad one is a single line like the
    # other usage errors of this command (an unreachable server, an unknown model).
    bench.add_argument("--base-url", default="http://127.0.0.1:8000")
    bench.add_argument("--model", default=None, help="default: the first one the server lists")
    bench.add_argument("--num-requests", type=int, default=64)
    bench.add_argument("--concurrency", type=int, default=8, help="most in flight")
    bench.add_argument("--input-len", type=int, default=256,
                       help="tokens of user text per request (each one distinct)")  # fmt: skip
    bench.add_argument("--output-len", type=int, default=128,
                       help="max_output_tokens of each request")  # fmt: skip
    bench.add_argument("--shared-prefix-len", type=int, default=0,
                       help="leading user-text tokens common to all requests")  # fmt: skip
    bench.add_argument("--instructions-len", type=int, default=0, metavar="N",
                       help="N tokens of instructions common to all requests, as an agent's "
                       "system prompt (default 0: none)")  # fmt: skip
    bench.add_argument("--request-rate", type=float, default=math.inf,
                       help="Poisson arrivals per second (default inf: all at once)")  # fmt: skip
    bench.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    bench.add_argument("--temperature", type=float, default=1.0)
    bench.add_argument("--reasoning-effort", choices=serve_load.REASONING_EFFORTS, default=None)
    bench.add_argument("--turns", type=int, default=1,
                       help="each request a dialogue of this many turns, each --input-len new "
                       "tokens (default 1)")  # fmt: skip
    bench.add_argument("--continue-with", choices=serve_load.CONTINUATIONS,
                       default="previous_response_id",
                       help="how a dialogue's turns follow each other (items: nothing stored, "
                       "every item sent back, as the Agents SDK and the Codex CLI do)")  # fmt: skip
    bench.add_argument("--tool-loop", action="store_true",
                       help="each turn must call a tool (tool_choice: required); the next turn "
                       "sends its output, --input-len tokens: an agent's loop")  # fmt: skip
    bench.add_argument("--tool-namespace", default=None, metavar="NAME",
                       help="with --tool-loop: the tool inside a namespace tool of this name "
                       "(called NAME.lookup, as the Codex CLI's sub-agent tools)")  # fmt: skip
    bench.add_argument("--endpoint", choices=tuple(serve_load.ENDPOINTS), default="responses",
                       help="/v1/responses, or /v1/chat/completions")  # fmt: skip
    bench.add_argument("--warmup", type=int, default=0,
                       help="requests run first and not counted")  # fmt: skip
    bench.add_argument("--seed", type=int, default=None, help="default: a random one (reported)")
    bench.add_argument("--timeout", type=float, default=600.0,
                       help="seconds of server silence that fail a request")  # fmt: skip
    bench.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    bench.add_argument("--api-key", default=None, metavar="KEY",
                       help="the server's API key (default: OPENAI_API_KEY, as the SDK reads "
                       "it; never written to the results)")  # fmt: skip


def run_bench_serve(args: argparse.Namespace) -> int:
    """The table on stdout (and JSON with --out); exit status 1 when every request failed."""
    if args.out is not None and not args.out.parent.is_dir():
        raise UsageError(f"--out: no directory {args.out.parent}")
    try:
        config = serve_load.BenchServeConfig(
            base_url=args.base_url, model=args.model, num_requests=args.num_requests,
            concurrency=args.concurrency, input_len=args.input_len, output_len=args.output_len,
            shared_prefix_len=args.shared_prefix_len, instructions_len=args.instructions_len,
            request_rate=args.request_rate,
            stream=args.stream, temperature=args.temperature,
            reasoning_effort=args.reasoning_effort, turns=args.turns,
            continue_with=args.continue_with, tool_loop=args.tool_loop,
            tool_namespace=args.tool_namespace,
            endpoint=args.endpoint, warmup=args.warmup,
            seed=random.randrange(2**31) if args.seed is None else args.seed,
            timeout_s=args.timeout, api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        )  # fmt: skip
    except ValueError as error:
        raise UsageError(str(error)) from error
    try:
        run = asyncio.run(serve_load.run_benchmark(config))
    except serve_load.BenchError as error:
        raise UsageError(str(error)) from error
    date = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    commit = os.environ.get("BENCH_COMMIT") or report.git_commit()
    summary = report.summarize(run, date=date, commit=commit)
    sys.stdout.write(report.format_table(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        sys.stderr.write(f"wrote {args.out}\n")
    return 0 if summary["num_ok"] else 1


COMMANDS = {
    "serve": run_serve,
    "bench": run_bench,
    "generate": run_generate,
    "logits": run_logits,
    "make-checkpoint": run_make_checkpoint,
    "bench-serve": run_bench_serve,
}


def main(argv: Sequence[str] | None = None) -> int:

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    configure_allocator()  # before anything starts CUDA (engine/allocator.py)
    try:
        return COMMANDS[args.command](args)
    except (UsageError, ConfigError, CheckpointError) as error:
        sys.stderr.write(f"gptoss-serve {args.command}: error: {error}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
