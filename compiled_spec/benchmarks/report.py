"""The markdown table and the two plots of a sweep's results."""

from __future__ import annotations

from pathlib import Path

from compiled_spec.compiler.torch_patches import AS_SHIPPED

from .anchors import ANCHORS


def engine_records(results: dict) -> list[dict]:
    return [r for r in results["records"] if r["kind"] == "engine"]


def anchor_records(results: dict) -> list[dict]:
    return [r for r in results["records"] if r["kind"] == "anchor"]


def number(value, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def k_order(k) -> tuple:
    """Fixed k in order, then auto."""
    return (k == "auto", 0 if k == "auto" else k)


def auto_rows(results: dict) -> list[str]:
    """One row per k = auto cell: what it chose, and its tokens/s against the best fixed k beside it."""
    cells = [r for r in engine_records(results) if r["num_speculative_tokens"] == "auto" and r["status"] == "ok"]
    if not cells:
        return []
    lines = ["", "k = auto chooses k before each step from the step times it measured at warm-up and the running "
                 "acceptance. Its tokens/s over the best fixed k: of the same mode and batch size in this sweep "
                 "(another process each), and with each k forced on the auto cell's own engine (same process, "
                 "same graphs, runs interleaved):", "",
             "| mode | batch | k chosen (steps) | auto tokens/s | best fixed k | its tokens/s | auto / best | "
             "same process: tokens/s by forced k | best | auto / best |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in cells:
        chosen = ", ".join(f"k={k}: {n}" for k, n in r.get("steps_per_num_drafts", {}).items())
        if r.get("tree_steps"):
            chosen += f" (the tree: {r['tree_steps']}, ended on a leaf: {r.get('leaf_steps', 0)})"
        forced = " / ".join(f"{number(rate)}" for k, rate in r.get("same_process_tokens_per_s", {}).items()
                            if k != "auto")
        lines.append(f"| {r['graph_mode']} | {r['batch_size']} | {chosen} | {number(r['tokens_per_s'])} | "
                     f"{r.get('best_fixed_k', '–')} | {number(r.get('best_fixed_k_tokens_per_s'))} | "
                     f"{number(r.get('auto_over_best_fixed_k'), 3)} | {forced or '–'} | "
                     f"{r.get('same_process_best_fixed_k', '–')} | "
                     f"{number(r.get('same_process_auto_over_best_fixed_k'), 3)} |")
    return lines


def acceptance_text(record: dict) -> str:
    if not record["num_speculative_tokens"]:
        return "–"
    return " ".join(f"{rate:.0%}" for rate in record["acceptance_rate_per_position"])


def engine_row(record: dict, anchors: list[str]) -> str:
    k = record["num_speculative_tokens"]
    vocab = record.get("draft_vocab_size")
    k_text = f"{k} (draft vocab {vocab})" if k and vocab else str(k)
    if record.get("draft_tree"):
        k_text += f" tree {','.join(map(str, record['draft_tree']))}"
    if record.get("drafter") not in (None, "mtp"):  # n-gram drafts; MTP modules are the usual drafter
        k_text += f" {record['drafter']}"

    head = f"| {record['graph_mode']} | {k_text} | {record['batch_size']} |"
    if record["status"] != "ok":
        return head + f" {record['status']}: {record.get('reason', '')} |" + " |" * (11 + len(anchors))
    latency = record["step_latency_ms"] or {"p50": float("nan"), "p90": float("nan")}
    same = record.get("acceptance_equals_eager")
    if same is False:  # how many accepted drafts moved, out of how many
        same = f"Δ{record.get('accepted_differs_from_eager_by', '?')} of {sum(record['accepted_per_position'])}"
    rounds = record.get("rounds_tokens_per_s")
    cells = [
        number(record["tokens_per_s"]) + (f" ({' / '.join(number(rate) for rate in rounds)})" if rounds else ""),
        f"{latency['p50']:.2f} / {latency['p90']:.2f}",
        acceptance_text(record),
        number(record["mean_accepted_length"], 2),
        "–" if same is None else ("yes" if same is True else same),
        "–" if "outputs_equal_to_hf_eager" not in record else f"{record['outputs_equal_to_hf_eager']}/{record['requests']}",
        number(record["warmup_s"]),
        number(record["peak_rss_mib"], 0),
        number(record["weight_bytes"] / 2**20) if "weight_bytes" in record else "–",
        record.get("weight_format", "–"),
    ]
    cells += [number(record["speedup_vs"].get(name), 2) + ("×" if record["speedup_vs"].get(name) else "")
              for name in [*anchors, "plain-limit"]]
    return head + " " + " | ".join(cells) + " |"


def startup_rows(results: dict) -> list[str]:
    """Cells with ahead-of-time packages (full on CPU): what their start cost and what the packages weigh."""
    packaged = [r for r in engine_records(results) if r["status"] == "ok" and r.get("packages_compiled", 0)
                + r.get("packages_loaded", 0) and "package_bytes" in r]
    if not packaged:
        return []
    lines = ["", "Start-up (full on CPU): warm-up compiles the packages it does not find and loads the others; "
             "package bytes on disk against the weights' bytes times the packages. The constants (frozen, "
             "pre-packed weights) are stored once beside the packages and shared by them.", "",
             "| mode | k | batch | packages compiled / loaded | warm-up s | package MB | shared constants MB "
             "| weights MB × packages | package / (weights × packages) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in packaged:
        r = {**r, **r.get("first_round", {})}  # with rounds: the first, which compiled what the cache lacked
        count = r["packages_compiled"] + r["packages_loaded"]
        weights = r["weight_bytes"] * count
        constants = r.get("constants_bytes")  # absent in runs whose packages carried their own weights
        lines.append(f"| {r['graph_mode']} | {r['num_speculative_tokens']} | {r['batch_size']} | "
                     f"{r['packages_compiled']} / {r['packages_loaded']} | {number(r['warmup_s'])} | "
                     f"{number(r['package_bytes'] / 1e6)} | {number(constants and constants / 1e6)} | "
                     f"{number(weights / 1e6)} | {r['package_bytes'] / weights:.0%} |")
    return lines


def anchor_row(record: dict) -> str:
    head = f"| {record['anchor']} | {record['batch_size']} |"
    if record["status"] != "ok":
        return head + f" {record['status']}: {record.get('reason', '')} | | | |"
    notes = []
    if record.get("mean_accepted_length") is not None:
        notes.append(f"k={record['num_speculative_tokens']}, ~{record['mean_accepted_length']:.2f} tokens/verify pass")
    if record.get("settings", {}).get("set_for_transformers"):
        notes.append(f"set: {record['settings']['set_for_transformers']}")
    return head + f" {number(record['tokens_per_s'])} | {number(record['warmup_s'])} | " \
                  f"{number(record['peak_rss_mib'], 0)} | {'; '.join(notes)} |"


def hisparse_text(hisparse: dict, records: list[dict]) -> str:
    used = sorted({r["hisparse_scorer"] for r in records if r.get("hisparse_scorer")})
    scorer = hisparse["scorer"] + (f" ({', '.join(used)})" if hisparse["scorer"] == "auto" and used else "")
    return (f" Every engine cell decodes with HiSparse: top {hisparse['top_k_tokens']} tokens per query through "
            f"{hisparse['hot_rows']} hot rows per layer, {scorer} scorer"
            + (f", a {hisparse['cold_dtype']} cold pool" if hisparse.get("cold_dtype") else "")
            + " (the anchors stay dense).")


def bandwidth_text(env: dict) -> str:
    readings = env.get("read_bandwidth_readings_gb_s")
    if not readings:
        return f"Memory read bandwidth at start: {number(env.get('read_bandwidth_gb_s'))} GB/s."
    text = (f"Memory read bandwidth: {number(readings.get('start'))} GB/s at start, {number(readings.get('end'))} at "
            f"end; '× plain limit' uses {number(env.get('read_bandwidth_gb_s'))}.")
    over = env.get("plain_cells_over_limit")
    if over:
        text += (f" **The probe read low:** {', '.join(over)} decoded plainly faster than that limit, which no plain "
                 "decoder can, so '× plain limit' overstates every cell of this run.")
    return text


def kernels_text(records: list[dict]) -> str:
    """What the compiled cells' CPU kernels were: built, or not (and why), since the fallbacks are slower."""
    states = sorted({record["cpu_kernels"] for record in records if record.get("cpu_kernels", "not needed")
                     != "not needed"})
    return f" CPU kernels: {'; '.join(states)}." if states else ""


def patches_summary(records: list[dict]) -> str:
    """Which of the changes to torch (compiler/torch_patches.py) the compiled cells ran with ("" for eager cells)."""
    patches = {name: key for record in records for name, key in record.get("torch_patches", {}).items()}
    shipped = sorted(name for name, key in patches.items() if key == AS_SHIPPED)
    if not patches or not shipped:
        return f"all {len(patches)} applied" if patches else ""
    return f"{len(patches) - len(shipped)} of {len(patches)} applied; as torch ships them: {', '.join(shipped)}"


def patches_text(records: list[dict]) -> str:
    summary = patches_summary(records)
    return f" Torch patches: {summary}." if summary else ""


def markdown(results: dict, plot_names: list[str] = ()) -> str:
    env, settings = results["environment"], results["settings"]
    anchors = [name for name in ANCHORS if any(r.get("anchor") == name for r in anchor_records(results))]
    lines = [
        "# compiled-spec bench",
        "",
        f"`{results['command']}`",
        "",
        f"{env['cpu']}, {env['usable_cpus']} usable CPUs, {env['memory_gib']} GiB; Python {env['python']}, "
        f"torch {env['torch']}, transformers {env['transformers']}, compiled-spec {env['compiled_spec']} "
        f"({env['git_commit']}); load average {env['load_average_at_start'][0]:.2f} at start, "
        f"{env.get('load_average_at_end', [float('nan')])[0]:.2f} at end. " + bandwidth_text(env)
        + kernels_text(engine_records(results)) + patches_text(engine_records(results)),
        "",
        f"{settings['prompts']} prompts ({min(settings['prompt_lengths'])}–{max(settings['prompt_lengths'])} tokens), "
        f"{settings['max_tokens']} new tokens each, {settings['sampling']}; max_seq_len {settings['max_seq_len']}, "
        f"{settings['buckets']} buckets, best of {settings['repeats']}"
        + (f" in each of {settings['rounds']} rounds (a fresh process per cell and round; tokens/s of every "
           f"round in brackets)." if settings.get("rounds", 1) > 1 else ".")
        + (hisparse_text(settings["hisparse"], engine_records(results)) if settings.get("hisparse") else ""),
        "",
        "tokens/s: generated tokens / wall time of generate() for all prompts, prefill included, after warm-up. "
        "Step latency: one decode step (all lanes) including the copy of its results to the host. "
        "Acceptance: per draft position, accepted drafts over verified ones (at a fixed k every step verifies "
        "every position). "
        "Warm-up: compiling every bucket (0 in eager). Peak RSS: the cell's own process. "
        "Weights MiB: the bytes the model's weights hold in memory (packed matrices at their packed size), "
        "and how the main model's matrices are held. "
        "'= eager': accepted counts per position equal the eager cell's (same k, batch), or by how many "
        "they differ; "
        "'= HF': outputs identical to transformers' greedy ones. "
        "'× plain limit': tokens/s over batch x bandwidth / weight bytes, the most any plain decoder "
        "(one read of the main model's weights per step) could make here.",
        "",
        "| " + " | ".join(["mode", "k", "batch", "tokens/s", "step p50 / p90 ms", "acceptance by position",
                           "mean accepted length", "= eager", "= HF", "warm-up s", "peak RSS MiB",
                           "weights MiB", "weights", *(f"× {name}" for name in anchors), "× plain limit"]) + " |",
        "|" + "---|" * (14 + len(anchors)),
    ]
    lines += [engine_row(record, anchors) for record in engine_records(results)]
    lines += auto_rows(results)
    lines += startup_rows(results)
    if anchors:
        lines += ["", "| anchor | batch | tokens/s | warm-up s | peak RSS MiB | notes |", "|---|---|---|---|---|---|"]
        lines += [anchor_row(record) for record in anchor_records(results)]
    lines += [""] + [f"![{name}]({name})" for name in plot_names]
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tokens_per_s(results: dict, path: Path) -> list[Path]:
    """Tokens/s by k, one bar per graph mode, one panel per batch size; anchors as dashed lines."""
    ok = [r for r in engine_records(results) if r["status"] == "ok"]
    if not ok:
        return []
    plt = _pyplot()
    batches = sorted({r["batch_size"] for r in ok})
    modes = list(dict.fromkeys(r["graph_mode"] for r in ok))
    ks = sorted({r["num_speculative_tokens"] for r in ok}, key=k_order)
    figure, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4), squeeze=False)
    width = 0.8 / len(modes)
    for axis, batch in zip(axes[0], batches):
        for index, mode in enumerate(modes):
            values = {r["num_speculative_tokens"]: r["tokens_per_s"] for r in ok
                      if r["graph_mode"] == mode and r["batch_size"] == batch}
            xs = [position + (index - (len(modes) - 1) / 2) * width for position, k in enumerate(ks) if k in values]
            axis.bar(xs, [values[k] for k in ks if k in values], width, label=mode)
        for style, anchor in zip(("--", ":", "-.", (0, (1, 3)), (0, (6, 2))), ANCHORS):
            match = [r for r in anchor_records(results)
                     if r["anchor"] == anchor and r["batch_size"] == batch and r["status"] == "ok"]
            if match:
                axis.axhline(match[0]["tokens_per_s"], color="gray", linestyle=style, label=anchor)
        axis.set_xticks(range(len(ks)), [f"k={k}" for k in ks])
        axis.set_title(f"batch {batch}")
        axis.set_ylabel("tokens/s")
    axes[0][0].legend(fontsize="small")
    figure.suptitle("Tokens/s by graph mode and k")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return [path]


def plot_acceptance(results: dict, path: Path) -> list[Path]:
    """Acceptance by draft position, one line per graph mode (pooled over batch sizes), one panel per k.

    Lines lying on top of each other are the point: capturing the step does not change what is accepted."""
    ok = [r for r in engine_records(results) if r["status"] == "ok" and r["num_speculative_tokens"] != "auto"
          and r["num_speculative_tokens"] > 0]
    if not ok:
        return []
    plt = _pyplot()
    ks = sorted({r["num_speculative_tokens"] for r in ok})
    modes = list(dict.fromkeys(r["graph_mode"] for r in ok))
    figure, axes = plt.subplots(1, len(ks), figsize=(max(4 * len(ks), 7), 3.6), squeeze=False)
    markers = ("o", "s", "^", "D")
    for axis, k in zip(axes[0], ks):
        for index, mode in enumerate(modes):
            cells = [r for r in ok if r["graph_mode"] == mode and r["num_speculative_tokens"] == k]
            if not cells:
                continue
            steps = sum(r["drafted"] for r in cells) / k
            accepted = [sum(r["accepted_per_position"][p] for r in cells) for p in range(k)]
            axis.plot(range(1, k + 1), [a / steps for a in accepted], marker=markers[index % len(markers)],
                      markersize=11 - 2.5 * index, label=mode)
        axis.set_xticks(range(1, k + 1))
        axis.set_ylim(0, 1.05)
        axis.set_xlabel("draft position")
        axis.set_title(f"k={k}")
    axes[0][0].set_ylabel("acceptance rate")
    axes[0][0].legend(fontsize="small")
    figure.suptitle("Acceptance by draft position; lines on top of each other: no collapse")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return [path]
