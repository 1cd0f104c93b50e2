"""`python -m bench.profile_llm`: where the `llm` model's time goes under load (py-spy).

Starts tritonserver with the `llm` model, keeps C streams busy with the benchmark's workload
(`bench.loadgen.TritonTarget`; with `--adapter`, completions through the OpenAI adapter at
niceness `--adapter-nice`), samples the stub and its engine process
(`backend.engine_process`) with `py-spy record` meanwhile, and prints the CPU each process used,
and for each of their threads the time it ran and the time it was runnable but waited for a CPU
(Linux schedstat), then the share of samples in which each thread, and each function of ours or
of pb_utils, was on the stack. Samples are taken with `--gil`: only a thread holding its
process's GIL counts. The two differ: the engine thread spends most of its CPU in torch without
the GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from backend import adapter_server, default_model
from backend.adapter_server import AdapterServer
from backend.engine_process import engine_of
from backend.repository import write_repository
from backend.tritonserver import TritonServer
from bench.environment import thread_schedstats
from bench.loadgen import Target, TritonTarget, explicit_ids, make_workload, run_load
from bench.run import adapter_target


def summarise(raw: Path, top: int) -> str:
    """Inclusive shares per thread and per frame, from py-spy's raw (collapsed) output."""
    threads: collections.Counter[str] = collections.Counter()
    frames: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        samples = int(count)
        parts = stack.split(";")
        total += samples
        # With --subprocesses a stack starts with its process, then its thread.
        thread = next((part for part in parts if part.startswith("thread (")), parts[0])
        threads[thread] += samples
        for frame in set(parts[parts.index(thread) + 1 :]):
            frames[frame] += samples
    lines = [f"{total} samples holding the GIL", "", "by thread:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in threads.most_common()]
    lines += ["", f"top {top} frames (inclusive):"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in frames.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_llm", description=__doc__)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=20, help="how long py-spy samples")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--native", action="store_true", help="C/C++ frames too (py-spy)")
    parser.add_argument(
        "--explicit-ids", type=int, default=0, help="LOGPROB_TOKEN_IDS per request (0 = none)"
    )
    parser.add_argument(
        "--adapter", action="store_true", help="the load through the OpenAI adapter, not gRPC"
    )
    parser.add_argument(
        "--adapter-nice",
        type=int,
        default=adapter_server.NICE,
        help="the adapter's niceness, as the launcher's flag of that name",
    )
    args = parser.parse_args(argv)
    if args.adapter and args.explicit_ids:
        parser.error("--explicit-ids is for the gRPC load only")
    from transformers import AutoTokenizer

    model = default_model.ensure().resolve()
    tokenizer = AutoTokenizer.from_pretrained(model)
    specs = make_workload(tokenizer, 8 * args.concurrency)
    with tempfile.TemporaryDirectory(prefix="profile-") as tmp:
        repository = write_repository(
            Path(tmp) / "model_repository", model, {"max_num_seqs": str(args.concurrency)}
        )
        server = TritonServer(repository, 0, 0, 0, log_path=Path(tmp) / "tritonserver.log")
        with server, contextlib.ExitStack() as adapters:
            assert server.pid is not None
            pid = next(stub.process.pid for stub in server.stubs if stub.model == "llm")
            ids = explicit_ids(len(tokenizer), args.explicit_ids) if args.explicit_ids else ()
            adapter = None
            if args.adapter:
                adapter = adapters.enter_context(
                    AdapterServer(
                        server.grpc_url,
                        port=0,
                        served_model_name="bench",
                        log_path=Path(tmp) / "adapter.log",
                        options={"log_level": "warning"},
                        nice=args.adapter_nice,
                    )
                )
            stop = threading.Event()

            def load() -> None:
                async def loop() -> None:
                    target: Target = (
                        adapter_target(adapter.url, False, args.concurrency)
                        if adapter is not None
                        else TritonTarget(server.grpc_url, logprob_token_ids=ids)
                    )
                    while not stop.is_set():
                        await run_load(target, specs, args.concurrency)
                    await target.aclose()

                asyncio.run(loop())

            driver = threading.Thread(target=load)
            driver.start()
            raw = Path(tmp) / "llm.txt"
            engine = engine_of(pid)
            processes = {
                "llm stub": psutil.Process(pid),
                "engine process": engine,
                "tritonserver": psutil.Process(server.pid),
                "load generator": psutil.Process(),
            }
            if adapter is not None and adapter.pid is not None:
                processes["adapter"] = psutil.Process(adapter.pid)
            for process in processes.values():
                process.cpu_percent()  # starts each process's window
            sampled = (pid, engine.pid)
            schedstat_before = {t: s for p in sampled for t, s in thread_schedstats(p).items()}
            started = time.monotonic()
            try:
                subprocess.run(
                    [
                        str(Path(sys.executable).parent / "py-spy"),
                        "record",
                        *("--pid", str(pid), "--duration", str(args.seconds)),
                        *("--gil", "--threads", "--subprocesses"),
                        *("--format", "raw", "--output", str(raw)),
                        *(["--native"] if args.native else []),
                    ],
                    check=True,
                    capture_output=True,
                )
                busy = {name: process.cpu_percent() for name, process in processes.items()}
                elapsed = time.monotonic() - started
                by_thread = {
                    tid: (
                        running - schedstat_before.get(tid, (0.0, 0.0))[0],
                        queued - schedstat_before.get(tid, (0.0, 0.0))[1],
                    )
                    for p in sampled
                    for tid, (running, queued) in thread_schedstats(p).items()
                }
            finally:
                stop.set()
                driver.join()
            print("CPU while sampled (100% = one core):")
            print("\n".join(f"  {share:5.0f}%  {name}" for name, share in busy.items()))
            print(
                "stub and engine threads by id (as py-spy names them below): on a CPU, and "
                "runnable but waiting for one (the rest of the time a thread sleeps: the GIL, a "
                "queue, IPC):"
            )
            busiest = sorted(by_thread.items(), key=lambda item: -item[1][0])[:6]
            print(
                "\n".join(
                    f"  {100 * running / elapsed:5.0f}%  {100 * queued / elapsed:5.0f}%  {tid}"
                    for tid, (running, queued) in busiest
                )
            )
            print(summarise(raw, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
