"""A load run as a JSON-ready summary, and that summary as the table the CLI prints."""

from __future__ import annotations

import logging
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

from gptoss_serve.benchmarks.serve_load import BenchRun, RequestResult
from gptoss_serve.benchmarks.stats import Distribution

logger = logging.getLogger(__name__)

MS = 1000.0
_MOST_ERRORS_SHOWN = 5


def summarize(run: BenchRun, *, date: str, commit: str | None) -> dict[str, Any]:
    """Everything the table shows, plus the settings and one row per request."""
    results = run.results
    ok = [result for result in results if result.is_ok]
    num_input = sum(result.input_tokens for result in ok)
    num_output = sum(result.output_tokens for result in ok)
    duration = run.duration_s
    ttfts = [result.ttft_s for result in ok if result.ttft_s is not None]
    tpots = [result.tpot_s for result in ok if result.tpot_s is not None]
    return {
        "date": date,
        "commit": commit,
        "base_url": run.config.root_url,
        "model": run.model,
        "settings": run.config.settings(),
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_failed": len(results) - len(ok),
        "statuses": dict(Counter(result.status for result in ok)),
        "errors": dict(Counter(result.error for result in results if not result.is_ok)),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": num_output / duration,  # tok/s
        "total_throughput": (num_input + num_output) / duration,  # tok/s
        "input_tokens": num_input,
        "output_tokens": num_output,
        "prompt_tokens_mean": _mean([result.prompt_tokens for result in results]),
        "ttft_ms": Distribution.of(ttfts).scaled(MS).to_dict(),
        "tpot_ms": Distribution.of(tpots).scaled(MS).to_dict(),
        "latency_ms": Distribution.of([result.latency_s for result in ok]).scaled(MS).to_dict(),
        "cached_tokens": sum(result.cached_tokens for result in ok),
        **_by_turn(ok),
        "requests": [_request_row(result) for result in results],
    }


def _by_turn(ok: list[RequestResult]) -> dict[str, Any]:
    """Dialogues (turns > 1): the first turns' and the later turns' first-token times, the
    share of the later turns' prompts that the prefix cache served, and the tokens each
    later turn computed (its prompt less what the cache served)."""
    later = [result for result in ok if result.turn > 1]
    if not later:
        return {}
    first = [result.ttft_s for result in ok if result.turn == 1 and result.ttft_s is not None]
    later_ttfts = [result.ttft_s for result in later if result.ttft_s is not None]
    num_input = sum(result.input_tokens for result in later)
    return {
        "ttft_first_turn_ms": Distribution.of(first).scaled(MS).to_dict(),
        "ttft_later_turns_ms": Distribution.of(later_ttfts).scaled(MS).to_dict(),
        "later_turns_cached_share": (
            sum(r.cached_tokens for r in later) / num_input if num_input else None
        ),
        "later_turns_input_tokens_mean": num_input / len(later),
        "later_turns_computed_tokens_mean": (
            sum(r.input_tokens - r.cached_tokens for r in later) / len(later)
        ),
    }


def _request_row(result: RequestResult) -> dict[str, Any]:
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * MS

    return {
        "index": result.index,
        "turn": result.turn,
        "status": result.status,
        "error": result.error,
        "prompt_tokens": result.prompt_tokens,
        "input_tokens": result.input_tokens,
        "output_tokens": result.output_tokens,
        "cached_tokens": result.cached_tokens,
        "num_deltas": len(result.delta_times_s),
        "started_ms": ms(result.started_s),
        "ttft_ms": ms(result.ttft_s),
        "tpot_ms": ms(result.tpot_s),
        "latency_ms": ms(result.latency_s),
    }


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None


def _instructions(settings: dict[str, Any]) -> str:
    length = settings.get("instructions_len")
    return f", instructions {length} tokens" if length else ""


def format_table(summary: dict[str, Any]) -> str:
    settings = summary["settings"]
    rate = settings["request_rate"]
    mode = "streaming" if settings["stream"] else "not streaming"
    if settings.get("endpoint", "responses") != "responses":
        mode = f"{settings['endpoint']}, {mode}"
    statuses = ", ".join(f"{name} {count}" for name, count in sorted(summary["statuses"].items()))
    lines = [
        f"bench-serve: model {summary['model']} at {summary['base_url']} ({mode}, "
        f"seed {settings['seed']})",
        f"  {summary['num_requests']} requests (warm-up {settings['warmup']}), concurrency "
        f"{settings['concurrency']}, request rate {'inf' if rate is None else f'{rate:g}/s'}",
        f"  input {settings['input_len']} tokens (shared {settings['shared_prefix_len']}), "
        f"output {settings['output_len']} tokens{_instructions(settings)}",
        *_dialogue_line(settings),
        "",
        f"{'requests ok':<20}{summary['num_ok']:>10}  ({statuses or 'none'})",
        f"{'requests failed':<20}{summary['num_failed']:>10}",
    ]
    errors = Counter(summary["errors"]).most_common(_MOST_ERRORS_SHOWN)
    lines += [f"{'':<20}{count:>10}  {error}" for error, count in errors]
    lines += [
        f"{'duration':<20}{summary['duration_s']:>10.2f}  s",
        f"{'request throughput':<20}{summary['request_throughput']:>10.2f}  req/s",
        f"{'output throughput':<20}{summary['output_throughput']:>10.1f}  tok/s "
        f"({summary['output_tokens']} tokens)",
        f"{'total throughput':<20}{summary['total_throughput']:>10.1f}  tok/s "
        f"({summary['input_tokens']} input + {summary['output_tokens']} output tokens)",
        "",
        f"{'':<20}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}",
    ]
    rows = [("TTFT (ms)", "ttft_ms"), ("TPOT (ms)", "tpot_ms"), ("latency (ms)", "latency_ms")]
    if "ttft_later_turns_ms" in summary:
        rows[1:1] = [("  turn 1", "ttft_first_turn_ms"), ("  turns 2+", "ttft_later_turns_ms")]
    for label, key in rows:
        row = summary[key]
        cells = "".join(_cell(row[name]) for name in ("p50", "p90", "p99", "mean"))
        lines.append(f"{label:<20}{cells}")
    if summary.get("later_turns_cached_share") is not None:
        share = summary["later_turns_cached_share"]
        computed = summary["later_turns_computed_tokens_mean"]
        lines.append(f"{'prefix cache':<20}{share:>10.1%}  of the later turns' prompts (mean "
                     f"{summary['later_turns_input_tokens_mean']:.0f} tokens, {computed:.0f} "
                     "computed a turn)")  # fmt: skip
    return "\n".join(lines) + "\n"


def _dialogue_line(settings: dict[str, Any]) -> list[str]:
    loop = settings.get("tool_loop")
    if settings["turns"] == 1:
        return ["  each request a tool call (tool_choice: required)"] if loop else []
    kind = "tool loop (each turn a call, the next its output)" if loop else "dialogue"
    return [f"  each request a {kind} of {settings['turns']} turns, continued by "
            f"{settings['continue_with']}"]  # fmt: skip


def _cell(value: float | None) -> str:
    return f"{'-':>10}" if value is None else f"{value:>10.1f}"


def git_commit() -> str | None:
    """HEAD of the checkout this package runs from, or None outside one (or without git)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.info("no commit recorded: %s", error)
        return None
    return done.stdout.strip() if done.returncode == 0 else None
