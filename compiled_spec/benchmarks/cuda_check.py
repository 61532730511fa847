"""CUDA replay parity and speed in one run (about 8 minutes on an H100/H200): which graph modes equal eager there.

    python -m compiled_spec.benchmarks.cuda_check [--out cuda_check_out] [--modes compile,piecewise,full] [--max-tokens 24]
                                    [--batch-sizes 1,8] [--budget-s 450] [--max-autotune] [--no-anchor]

Parity: the default model, k=3, the batch sizes as buckets; greedy and seeded requests decoded together, with
HiSparse off and saturated (every step evicts). For each graph mode x sampling x HiSparse: tokens equal to eager's,
per-step accepted counts equal to eager's, CUDA graph replays (> 0 for piecewise and full), cudagraph skips (0)
and graph partitions.
Speed: tokens/s of each mode at each batch size beside transformers' static-cache compiled generate on the same
model. full runs inductor's default options here (the parity question is the capture, not the kernels);
--max-autotune adds a separate last stage with full's own max-autotune options. Stages that no longer fit in
--budget-s are skipped and say so. Prints one table and writes cuda_check.json (after every stage) under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

MODES = ("compile", "piecewise", "full")
# saturated: k=3, a pass writes up to 6 rows, so every step evicts. The cold pool on the GPU: a host pool cannot be
# captured, and full raises on what it cannot capture whole.
HISPARSE = {"off": None, "saturated": dict(top_k_tokens=4, hot_rows=10, cold_pool="device")}
K = 3
# One engine shape for the parity and the speed stages (batch buckets from --batch-sizes), so the speed stage's
# graphs come from inductor's caches instead of compiling again.
ENGINE = dict(num_speculative_tokens=K, max_seq_len=128, prefill_buckets=(32,))
PROMPT_LENGTHS = (3, 17, 5, 9, 30, 1, 12, 7)


@dataclass
class ParityRow:
    mode: str
    sampling: str  # greedy | seeded
    hisparse: str  # off | saturated
    tokens_equal: bool | None = None
    accepted_equal: bool | None = None
    replays: int | None = None
    cudagraph_skips: int | None = None
    partitions: int | None = None
    error: str | None = None

    @property
    def status(self) -> str:
        """ok, or the first thing wrong."""
        if self.error is not None:
            return self.error
        if not self.tokens_equal:
            return "tokens differ"
        if not self.accepted_equal:
            return "accepted counts differ"
        if self.cudagraph_skips:
            return "cudagraphs skipped"
        if self.mode.startswith(("piecewise", "full")) and not self.replays:
            return "no CUDA graph replayed"
        return "ok"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class Results:
    device: str = ""
    torch: str = ""
    parity: list[ParityRow] = field(default_factory=list)
    tokens_per_s: dict[str, dict[str, float | None]] = field(default_factory=dict)  # mode -> batch -> tok/s
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        out = asdict(self)
        for row, record in zip(self.parity, out["parity"]):
            record["ok"], record["status"] = row.ok, row.status
        return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m compiled_spec.benchmarks.cuda_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("cuda_check_out"))
    parser.add_argument("--modes", type=_names(MODES), default=MODES,
                        help="compiled graph modes to compare with eager (comma-separated)")
    parser.add_argument("--batch-sizes", type=_positive_ints, default=(1, 8))
    parser.add_argument("--max-tokens", type=int, default=24, help="new tokens per request")
    parser.add_argument("--budget-s", type=float, default=450.0, help="stages that would not fit are skipped")
    parser.add_argument("--max-autotune", action="store_true", help="a last stage: full with max-autotune")
    parser.add_argument("--no-anchor", dest="anchor", action="store_false",
                        help="skip transformers' static-cache compiled generate")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be 1 or more")
    return args


def _names(allowed):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(name.strip() for name in text.split(",") if name.strip())
        unknown = [name for name in names if name not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{','.join(unknown) or text!r}: choose from {', '.join(allowed)}")
        return names

    return parse


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes are 1 or more")
    return values


def format_table(results: Results) -> str:
    """The parity table, then tokens/s per mode and batch size."""
    def cell(value):
        return "-" if value is None else ("yes" if value is True else "NO" if value is False else str(value))

    head = ("mode", "sampling", "hisparse", "tokens=eager", "accepted=eager", "replays", "skips", "partitions", "")
    rows = [head] + [(r.mode, r.sampling, r.hisparse, cell(r.tokens_equal), cell(r.accepted_equal), cell(r.replays),
                      cell(r.cudagraph_skips), cell(r.partitions), r.status)
                     for r in results.parity]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(value).ljust(width) for value, width in zip(row, widths)).rstrip() for row in rows]
    batches = sorted({int(b) for speeds in results.tokens_per_s.values() for b in speeds})
    if batches:
        lines += ["", "tokens/s  " + "  ".join(f"batch {b:>3}" for b in batches)]
        for mode, speeds in results.tokens_per_s.items():
            values = [speeds.get(str(b)) for b in batches]
            lines.append(f"{mode:<9} " + "  ".join(f"{v:>9.1f}" if v is not None else f"{'-':>9}" for v in values))
    lines += [f"skipped: {s}" for s in results.skipped] + [f"error: {e}" for e in results.errors]
    return "\n".join(lines)


def write_results(results: Results, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cuda_check.json"
    path.write_text(json.dumps(results.to_json(), indent=2) + "\n")
    return path


def compare(eager: tuple, run: tuple, requests: set[int]) -> tuple[bool, bool]:
    """(tokens equal, per-step accepted counts equal) over the given request indexes."""
    (eager_tokens, eager_steps), (tokens, steps) = eager, run
    def lanes(log):
        return [[lane for lane in step if lane[0] in requests] for step in log]
    return (all(tokens[i] == eager_tokens[i] for i in requests),
            [s for s in lanes(steps) if s] == [s for s in lanes(eager_steps) if s])


class ReplayCounter:
    """Counts torch.cuda.CUDAGraph.replay calls (cudagraph trees replay through it)."""

    def __init__(self):
        import torch

        self.count = 0
        self._original = torch.cuda.CUDAGraph.replay
        counter = self

        def replay(graph):
            counter.count += 1
            return counter._original(graph)

        torch.cuda.CUDAGraph.replay = replay


def light_full_options():
    """full without max-autotune (the parity stages): inductor's default kernels, still one captured graph."""
    from compiled_spec.config import GraphMode
    from compiled_spec.compiler import step_runner

    original = step_runner._mode_options

    def options(mode, device):
        chosen = original(mode, device)
        if mode == GraphMode.FULL:
            chosen = {k: v for k, v in chosen.items() if not k.startswith(("max_autotune", "coordinate_descent"))}
        return chosen

    step_runner._mode_options = options
    return lambda: setattr(step_runner, "_mode_options", original)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("cuda_check needs a CUDA device: torch.cuda.is_available() is False here", file=sys.stderr)
        return 2
    start = time.perf_counter()
    results = Results(device=torch.cuda.get_device_name(), torch=torch.__version__)
    replays = ReplayCounter()

    def left() -> float:
        return args.budget_s - (time.perf_counter() - start)

    def save():
        write_results(results, args.out)

    run_parity(args, results, replays, left, save)
    run_speed(args, results, left, save)
    if args.max_autotune:
        if left() > 150:
            run_parity(args, results, replays, left, save, modes=("full",), label="full+max-autotune",
                       light=False, hisparse_levels=("off",))
        else:
            results.skipped.append(f"full+max-autotune: {left():.0f} s left")
    save()
    print(format_table(results))
    print(f"wrote {args.out / 'cuda_check.json'} ({time.perf_counter() - start:.0f} s)")
    return 0 if all(row.ok for row in results.parity) else 1


def engine_shape(args) -> dict:
    return dict(ENGINE, max_batch_size=max(args.batch_sizes), batch_buckets=tuple(sorted(set(args.batch_sizes))))


def _workload(vocab: int, max_tokens: int):
    import torch

    from compiled_spec import SamplingParams

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seeded = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=11)
    params = [greedy if i % 2 == 0 else seeded for i in range(len(prompts))]
    return prompts, params, {"greedy": set(range(0, len(prompts), 2)), "seeded": set(range(1, len(prompts), 2))}


def _decode(llm, prompts, params):
    llm.engine.step_log.clear()
    outputs = llm.generate(prompts, params)
    return [o.token_ids for o in outputs], list(llm.engine.step_log)


def run_parity(args, results, replays, left, save, modes=None, label=None, light=True, hisparse_levels=HISPARSE):
    import torch
    from torch._dynamo.utils import counters

    from compiled_spec import LLM, HiSparseConfig

    restore = light_full_options() if light else (lambda: None)
    try:
        for level in hisparse_levels:
            hisparse = HiSparseConfig(**HISPARSE[level]) if HISPARSE[level] else None
            eager_llm = LLM(graph_mode="eager", device="cuda", hisparse=hisparse, **engine_shape(args))
            prompts, params, groups = _workload(eager_llm.model.config.vocab_size, args.max_tokens)
            eager = _decode(eager_llm, prompts, params)
            del eager_llm
            for mode in modes or args.modes:
                name = label or mode
                if left() < 60:
                    results.skipped.append(f"{name} hisparse {level}: {left():.0f} s left")
                    continue
                inductor = counters["inductor"]
                skips, partitions = inductor["cudagraph_skips"], inductor["cudagraph_partitions"]
                rows = [ParityRow(name, sampling, level) for sampling in groups]
                try:
                    llm = LLM(graph_mode=mode, device="cuda", hisparse=hisparse, show_progress=False,
                              **engine_shape(args))
                    before = replays.count
                    with torch.compiler.set_stance("fail_on_recompile"):
                        run = _decode(llm, prompts, params)
                    for row, requests in zip(rows, groups.values()):
                        row.tokens_equal, row.accepted_equal = compare(eager, run, requests)
                        row.replays = replays.count - before
                        row.cudagraph_skips = counters["inductor"]["cudagraph_skips"] - skips
                        row.partitions = counters["inductor"]["cudagraph_partitions"] - partitions
                    del llm
                except Exception as error:  # each cell fails on its own
                    for row in rows:
                        row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
                results.parity += rows
                save()
                torch.cuda.empty_cache()
    finally:
        restore()


def run_speed(args, results, left, save):
    import torch

    from compiled_spec import LLM, SamplingParams

    restore = light_full_options()
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    try:
        for mode in ("eager", *args.modes):
            if left() < 45:
                results.skipped.append(f"tokens/s of {mode}: {left():.0f} s left")
                continue
            speeds = results.tokens_per_s.setdefault(mode, {})
            try:
                llm = LLM(graph_mode=mode, device="cuda", show_progress=False, **engine_shape(args))
                for batch in args.batch_sizes:
                    prompts = [[5 + i, 9, 17, 3, 11, 2, 8, 4] for i in range(batch)]
                    llm.generate(prompts, params)  # first calls: allocations, cudagraph recording
                    torch.cuda.synchronize()
                    begin = time.perf_counter()
                    outputs = llm.generate(prompts, params)
                    torch.cuda.synchronize()
                    speeds[str(batch)] = sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - begin)
                del llm
            except Exception as error:
                results.errors.append(f"tokens/s of {mode}: {type(error).__name__}: {str(error)[:160]}")
            save()
        if args.anchor and left() > 60:
            try:
                results.tokens_per_s["hf-static"] = hf_static_tokens_per_s(args.batch_sizes)
            except Exception as error:
                results.errors.append(f"hf-static: {type(error).__name__}: {str(error)[:160]}")
        elif args.anchor:
            results.skipped.append(f"hf-static: {left():.0f} s left")
    finally:
        restore()
    save()


def hf_static_tokens_per_s(batch_sizes) -> dict[str, float]:
    """transformers generate with a static cache and its own torch.compile of the forward, greedy, 64 new tokens."""
    import torch
    import transformers
    from transformers import CompileConfig

    from compiled_spec.api import DEFAULT_MODEL

    model = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).cuda().eval()
    model.generation_config.eos_token_id = None
    kwargs = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0,
                  cache_implementation="static", compile_config=CompileConfig())
    speeds = {}
    with torch.inference_mode():
        for batch in batch_sizes:
            input_ids = torch.tensor([[5 + i, 9, 17, 3, 11, 2, 8, 4] for i in range(batch)], device="cuda")
            model.generate(input_ids, **kwargs)  # compiles
            torch.cuda.synchronize()
            begin = time.perf_counter()
            out = model.generate(input_ids, **kwargs)
            torch.cuda.synchronize()
            speeds[str(batch)] = (out.shape[1] - input_ids.shape[1]) * batch / (time.perf_counter() - begin)
    return speeds


if __name__ == "__main__":
    sys.exit(main())
