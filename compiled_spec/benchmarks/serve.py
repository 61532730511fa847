"""Load on a live `compiled-spec serve`: N concurrent streaming clients for a bounded time, per N.

    python -m compiled_spec.benchmarks.serve --concurrency 1,4,16 --duration 20 --out benchmarks/results/serve

Each client sends greedy completions of the sweep's prompts back to back (EOS ignored, --max-tokens each)
until the level's time is up; requests in flight then finish. Reported per level: output tokens/s over
the level's wall time, time to first token and inter-token latency (between streamed chunks; a
speculative step can stream several tokens in one chunk) p50/p99, per-request decode rate, acceptance
per draft position (from the responses' usage), errors, and the server's resident memory after warm-up and after
each level. Memory must stay flat: fitted over the levels after the first (which allocates the working set), RSS
may grow at most --max-rss-growth MiB per level, or the run exits 1 naming the growth. A level of more clients holds
more at once, so repeat one level for the leak check (--concurrency 8,8,8). With --llama-cpp-gguf FILE, llama.cpp's
OpenAI-compatible server (`python -m llama_cpp.server`, when llama-cpp-python is installed) runs the same
load beside it; it is skipped with the reason otherwise. Writes OUT/serve.json, OUT/serve.md and the servers'
logs in OUT/logs/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from .environment import describe
from .live_server import running_server
from .workload import DEFAULT_TEXT_PROMPTS


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def one_request(client, model: str, prompt: str, max_tokens: int, spec_usage: bool) -> dict:
    start = time.perf_counter()
    chunk_times, usage, tokens = [], None, 0
    extra = {"stream_options": {"include_usage": True}} if spec_usage else {}
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}, **extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            chunk_times.append(time.perf_counter())
            tokens += 1  # a server without usage: one chunk per token
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    end = time.perf_counter()
    completion_tokens = usage["completion_tokens"] if usage else tokens
    return {
        "ttft_s": chunk_times[0] - start if chunk_times else None,
        "itl_s": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
        "decode_tokens_per_s": (completion_tokens - 1) / (end - chunk_times[0])
        if chunk_times and end > chunk_times[0] and completion_tokens > 1 else None,
        "completion_tokens": completion_tokens,
        "spec_decode": (usage or {}).get("spec_decode"),
    }


def run_level(client, model: str, concurrency: int, duration_s: float, max_tokens: int, spec_usage: bool) -> dict:
    deadline = time.perf_counter() + duration_s
    results, errors, lock = [], [], threading.Lock()

    def worker(number: int) -> None:
        index = number
        while time.perf_counter() < deadline:
            prompt = DEFAULT_TEXT_PROMPTS[index % len(DEFAULT_TEXT_PROMPTS)]
            index += concurrency
            try:
                result = one_request(client, model, prompt, max_tokens, spec_usage)
            except Exception as error:  # counted and reported; the load goes on
                with lock:
                    errors.append(f"{type(error).__name__}: {error}")
                continue
            with lock:
                results.append(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(number,)) for number in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    itl = [gap for r in results for gap in r["itl_s"]]
    decode = [r["decode_tokens_per_s"] for r in results if r["decode_tokens_per_s"] is not None]
    spec = [r["spec_decode"] for r in results if r["spec_decode"]]
    record = {
        "concurrency": concurrency, "duration_s": duration_s, "wall_s": wall, "requests": len(results),
        "errors": len(errors), "error_samples": errors[:3],
        "output_tokens": sum(r["completion_tokens"] for r in results),
        "output_tokens_per_s": sum(r["completion_tokens"] for r in results) / wall,
        "ttft_ms": {"p50": 1000 * percentile(ttft, 50), "p99": 1000 * percentile(ttft, 99)} if ttft else None,
        "itl_ms": {"p50": 1000 * percentile(itl, 50), "p99": 1000 * percentile(itl, 99)} if itl else None,
        "decode_tokens_per_s_per_request_p50": statistics.median(decode) if decode else None,
    }
    if spec:
        drafts = sum(s["num_drafts"] for s in spec)
        per_position = [sum(s["num_accepted_tokens_per_pos"][p] for s in spec)
                        for p in range(spec[0]["num_speculative_tokens"])]
        record["acceptance_rate_per_position"] = [count / drafts for count in per_position] if drafts else None
        record["mean_accepted_length"] = (sum(per_position) + drafts) / drafts if drafts else None
    return record


def servers(args) -> list[tuple[str, list[str] | None, str, str]]:
    """(name, command or None, model name, reason when skipped)."""
    ours = [sys.executable, "-m", "compiled_spec.cli", "serve", "--port", "{port}", "-k", str(args.k), "--max-batch-size",
            str(args.max_batch_size), "--max-seq-len", str(args.max_seq_len), "--served-model-name", "bench",
            "--log-level", "warning", "--max-queue", "1024"]
    if args.model:
        ours += ["--model", args.model]
    if args.graph_mode:
        ours += ["--graph-mode", args.graph_mode]
    listed = [(f"compiled-spec (k={args.k}, {args.graph_mode or 'default mode'})", ours, "bench", "")]
    if args.llama_cpp_gguf is None:
        listed.append(("llama.cpp server", None, "", "no --llama-cpp-gguf given (this model has no GGUF file)"))
    elif importlib.util.find_spec("llama_cpp") is None:
        listed.append(("llama.cpp server", None, "", "llama-cpp-python is not installed"))
    else:
        command = [sys.executable, "-m", "llama_cpp.server", "--model", args.llama_cpp_gguf, "--host", "127.0.0.1",
                   "--port", "{port}", "--n_ctx", str(args.max_seq_len), "--model_alias", "bench",
                   "--n_threads", str(args.threads),
                   "--interrupt_requests", "False"]  # its default: a new request cancels the one streaming
        listed.append(("llama.cpp server", command, "bench", ""))
    return listed


def resident_mib(pid: int) -> float:
    """The server process's resident memory (its own, not a compile child's), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def latency_pair(values: dict | None) -> str:
    return "–" if not values else f"{values['p50']:.1f} / {values['p99']:.1f}"


def markdown(results: dict) -> str:
    lines = ["| server | clients | requests | errors | output tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "decode tokens/s per request (p50) | acceptance by position | tokens/step | RSS MiB after warm-up / at end |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    growth = [f"{server['name']}: RSS {server['rss_growth_mib_per_level']:+.2f} MiB per level after the first"
              for server in results["servers"] if server.get("rss_growth_mib_per_level") is not None]
    for server in results["servers"]:
        if server.get("skipped"):
            lines.append(f"| {server['name']} | skipped: {server['skipped']} | | | | | | | | | |")
            continue
        for level in server["levels"]:
            rates = level.get("acceptance_rate_per_position")
            tokens_per_step = level.get("mean_accepted_length")
            cells = [server["name"], level["concurrency"], level["requests"], level["errors"],
                     f"{level['output_tokens_per_s']:.1f}", latency_pair(level["ttft_ms"]),
                     latency_pair(level["itl_ms"]),
                     f"{level['decode_tokens_per_s_per_request_p50'] or 0:.1f}",
                     " ".join(f"{r:.0%}" for r in rates) if rates else "–",
                     f"{tokens_per_step:.2f}" if tokens_per_step else "–",
                     f"{server['rss_mib_after_warm_up']:.0f} / {level['rss_mib_at_end']:.0f}"]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines + [""] + growth) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Checkpoint directory (default: the embedded model).")
    parser.add_argument("--graph-mode", default=None, choices=("eager", "compile", "piecewise", "full"))
    parser.add_argument("-k", type=int, default=3, help="Drafts per step.")
    parser.add_argument("--concurrency", default="1,4,16", help="Comma-separated numbers of concurrent clients.")
    parser.add_argument("--duration", type=float, default=20.0, help="Seconds of load per level.")
    parser.add_argument("--max-tokens", type=int, default=64, help="Tokens per request (EOS ignored).")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=160)
    parser.add_argument("--llama-cpp-gguf", default=None, help="GGUF of the same model for llama.cpp's server.")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each server.")
    parser.add_argument("--max-rss-growth", type=float, default=5.0,
                        help="MiB per level that compiled-spec's RSS may grow after the first level (a leak check).")
    parser.add_argument("--out", default="bench_out/serve")
    args = parser.parse_args(argv)
    levels = [int(part) for part in args.concurrency.split(",") if part]
    if not levels or min(levels) < 1:
        parser.error(f"--concurrency {args.concurrency!r}: give positive integers, e.g. 1,4,16")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"command": ["python", "-m", "compiled_spec.benchmarks.serve", *(argv if argv is not None else sys.argv[1:])],
               "machine": describe(), "max_tokens": args.max_tokens, "servers": []}
    for name, command, model, reason in servers(args):
        if command is None:
            results["servers"].append({"name": name, "skipped": reason})
            continue
        health = "/v1/models" if "llama_cpp.server" in command else "/health"
        env = {"OMP_NUM_THREADS": str(args.threads)}
        (out / "logs").mkdir(exist_ok=True)
        with running_server(command, out / "logs" / f"{name.split()[0]}.log", health=health, startup_timeout_s=3600,
                            env=env) as live:
            client = live.client()
            one_request(client, model, DEFAULT_TEXT_PROMPTS[0], 8, True)  # warm: first-request costs out of the way
            server = {"name": name, "levels": [], "rss_mib_after_warm_up": resident_mib(live.process.pid)}
            for concurrency in levels:
                level = run_level(client, model, concurrency, args.duration, args.max_tokens,
                                  spec_usage="compiled-spec" in name)
                level["rss_mib_at_end"] = resident_mib(live.process.pid)  # growth here would be a leak
                server["levels"].append(level)
                print(f"{name}: {concurrency} clients: {level['output_tokens_per_s']:.1f} tokens/s, "
                      f"{level['requests']} requests, {level['errors']} errors", flush=True)
            server["rss_growth_mib_per_level"] = rss_growth_per_level(server)
            results["servers"].append(server)
    (out / "serve.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (out / "serve.md").write_text(table)
    print(table, end="")
    leaks = rss_leaks(results, args.max_rss_growth)
    if leaks:
        sys.exit("\n".join(leaks))


def rss_leaks(results: dict, max_growth_mib: float) -> list[str]:
    """One line for each compiled-spec server whose RSS grew more than max_growth_mib per level after the first."""
    return [f"{server['name']}: RSS grew {growth:.1f} MiB per level after the first (allowed: at most "
            f"{max_growth_mib:g}); at the end of each level: {[round(l['rss_mib_at_end'], 1) for l in server['levels']]}"
            for server in results["servers"] if "compiled-spec" in server["name"]
            and (growth := server.get("rss_growth_mib_per_level")) is not None and growth > max_growth_mib]


def rss_growth_per_level(server: dict) -> float | None:
    """The least-squares slope of the RSS at the end of each level, over the levels after the first; None with fewer
    than two such levels."""
    after_first = [level["rss_mib_at_end"] for level in server["levels"][1:]]
    if len(after_first) < 2:
        return None
    return statistics.linear_regression(range(len(after_first)), after_first).slope


if __name__ == "__main__":
    main()
