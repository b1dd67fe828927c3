"""Where the host's time goes in one engine step (GPU machine): schedule, prepare the inputs,
launch the forward (graph replay or eager), launch sampling, wait for the tokens, update.

    PYTHONPATH=src python3 bench/engine_host_profile.py [--model synthetic-120b] [--batch 1 64]

Prints one table per batch size: the median of each phase over the measured decode steps,
and the whole step. "wait" is the device time the host could not hide.
"""

from __future__ import annotations

import argparse
import statistics
import time

from gptoss_serve.config import EngineConfig, SamplingParams, SchedulerConfig
from gptoss_serve.engine.startup import build_engine
from gptoss_serve.engine.synthetic_weights import synthetic_model_config, synthetic_weights

PHASES = ("schedule", "prepare+launch", "sample launch", "wait", "update")


def profile(make_core, batch: int, context: int, steps: int) -> dict[str, float]:
    core = make_core()
    for index in range(batch):
        prompt = [(index * 7919 + j) % 200_000 for j in range(context)]
        core.add_request(f"p{index}", prompt, SamplingParams(max_tokens=steps + 64, seed=index))
    while any(r.num_computed_tokens < context for r in core.scheduler.requests.values()):
        core.step()
    times: dict[str, list[float]] = {phase: [] for phase in (*PHASES, "step")}
    for _ in range(steps):
        t0 = time.perf_counter()
        output = core.scheduler.schedule()
        t1 = time.perf_counter()
        logits, inputs = core.runner.forward(output)
        t2 = time.perf_counter()
        sampling = core._sampling_batch(inputs.sampled_request_ids)
        device_tokens = core.runner.launch_sampling(logits, sampling, None)
        t3 = time.perf_counter()
        tokens = device_tokens.tolist()
        t4 = time.perf_counter()
        core.scheduler.update_from_output(output, dict(zip(inputs.sampled_request_ids, tokens,
                                                           strict=True)))  # fmt: skip
        t5 = time.perf_counter()
        for phase, start, end in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5),
                                     strict=True):  # fmt: skip
            times[phase].append(end - start)
        times["step"].append(t5 - t0)
    core.close()
    return {phase: 1e6 * statistics.median(values) for phase, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="synthetic-120b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    weights = synthetic_weights(synthetic_model_config(args.model), device="cuda")
    # The phases of a step in turn (async scheduling overlaps them with the device; the
    # engine bench measures that).
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max(args.batch)),
                          async_scheduling=False)  # fmt: skip
    make_core, _, _ = build_engine(weights, config)
    print(f"{'batch':>5} " + " ".join(f"{p:>15}" for p in (*PHASES, "step")) + "  (us, median)")  # noqa: T201
    for batch in args.batch:
        row = profile(make_core, batch, args.context, args.steps)
        print(f"{batch:>5} " + " ".join(f"{row[p]:15.0f}" for p in (*PHASES, "step")))  # noqa: T201


if __name__ == "__main__":
    main()
