"""Train DeepSeek-V3-style MTP modules for a base model that has none, by self-distillation.

The base model stays frozen. It continues prompts from each domain greedily (self_generated.py), so the windows
read as decoding reads them, and its post-norm hidden states and greedy predictions along the way are cached;
module m at row i sees the base hidden (or module m-1's output) and the embedding of token i+m, and learns to
predict what the base model itself predicts at row i+m. So the loss optimizes exactly what greedy verification
accepts. The head is the base model's (frozen) LM head restricted to a frequency-ranked
sub-vocabulary, the draft vocabulary the engine drafts over.

    compiled-spec train-mtp --model smollm2-135m --out DIR [--num-modules N] [--corpus code,prose,chat] [--resume]

Outputs in DIR: mtp.safetensors (DeepSeek-V3 names, model.layers.{num_layers + j}.*, plus `d2t`, the whole
vocabulary ranked by how often the base model predicts each token), mtp_config.json (every hyper-parameter and
the seed), training_log.json and loss_curve.png. Attach with `LLM(base, mtp=DIR)` or `--mtp DIR`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ..loading.checkpoint import MTP_CONFIG_NAME, MTP_WEIGHTS_NAME, read_checkpoint
from ..loading.registry import resolve_model
from ..loading.tokenizer import load_tokenizer
from . import loop
from .mtp_corpus import DEF_LINE, DOMAINS, chat_prompts, code_texts, line_prompts, prose_texts
from .mtp_reference import DECODER_CLASSES, export_mtp_state_dict, mtp_chain, mtp_layers
from .self_generated import (checkpoint_digest, generation_batch, load_shards, records_digest,
                             self_generated_shards)

DEFAULT_CONFIG = Path(__file__).parent / "train_mtp_config.json"
IGNORE = -100
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_named(config: dict, section: str, key: str) -> torch.dtype:
    name = config[section].get(key, "float32")
    if name not in DTYPES:
        raise ValueError(f"{section}.{key} is {name!r}; choose {' or '.join(DTYPES)}")
    return DTYPES[name]


def load_base(path: Path):
    """The base model as transformers builds it (frozen, eval mode) and its raw config dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw, tensors = read_checkpoint(path)
    model_type = raw.get("model_type")
    if model_type not in DECODER_CLASSES:
        raise ValueError(f"train-mtp supports {', '.join(DECODER_CLASSES)} base models, not {model_type!r}")
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(model_type, **fields)
    config._attn_implementation = "sdpa"
    base = AutoModelForCausalLM.from_config(config)
    tensors = {k: v.float() for k, v in tensors.items() if not k.startswith("model.layers.") or
               int(k.split(".")[2]) < config.num_hidden_layers}
    result = base.load_state_dict(tensors, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        raise ValueError(f"base checkpoint {path} is missing {missing[:3]}")
    if config.tie_word_embeddings:
        base.tie_weights()
    return base.eval().requires_grad_(False), config


def domain_prompts(config: dict, tokenizer, work_dir: Path) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """{domain: (train prompts, held-out prompts)} as token ids, for the domains the config names: lines of code
    and of plays ending at a line end, then (corpus.function_prompts) code ending with a `def` line, and chat
    prompts in the model's chat template."""
    from ..chat import chat_prompt

    corpus = config["corpus"]
    counts, length = corpus["prompts"], corpus["prompt_tokens"]
    held_out_count = corpus["held_out_prompts"]
    out = {}
    for domain in corpus["domains"]:
        if domain in ("code", "prose"):
            if domain == "code":
                train, held_out = code_texts(corpus["code_chars"], corpus["code_held_out_percent"])
            else:
                train, held_out = prose_texts(work_dir, corpus["prose_held_out_works"], corpus["prose_chars"])
            train_prompts = line_prompts(train, counts[domain], length, tokenizer, config["seed"])
            held_out_prompts = line_prompts(held_out, held_out_count, length, tokenizer, config["seed"])
            if domain == "code" and corpus.get("function_prompts", 0):
                # After the line prompts, so the cached windows of those are kept.
                train_prompts += line_prompts(train, corpus["function_prompts"], length, tokenizer,
                                              config["seed"] + 1, ends=DEF_LINE)
                held_out_prompts += line_prompts(held_out, held_out_count, length, tokenizer, config["seed"] + 1,
                                                 ends=DEF_LINE)
            later_chars = corpus.get("later_code_chars", 0) if domain == "code" else 0
            # Every training module up to code_chars + later_code_chars (code_texts keeps its order as the limit
            # grows); the held-out modules stay those of code_chars.
            every = code_texts(corpus["code_chars"] + later_chars, corpus["code_held_out_percent"])[0] \
                if later_chars else train
            if later_chars:
                # Modules past the first code_chars, with prompts of their own after all of the above, so the
                # windows cached for those are kept.
                later = every[len(train):]
                train_prompts += line_prompts(later, corpus["later_code_prompts"], length, tokenizer,
                                              config["seed"] + 2, distinct=True)
                train_prompts += line_prompts(later, corpus["later_function_prompts"], length, tokenizer,
                                              config["seed"] + 3, ends=DEF_LINE, distinct=True)
            if domain == "code" and corpus.get("fresh_code_prompts", 0) + corpus.get("fresh_function_prompts", 0):
                # corpus.fresh_code_rounds rounds of new draws over all the training modules (earlier and later),
                # after everything above, each with seeds of its own; none equals a prompt from before its round
                # (a def-line draw can equal a line-end draw of its own round: 17 and 20 in the shipped two rounds).
                for round_ in range(corpus.get("fresh_code_rounds", 1)):
                    earlier = list(train_prompts)
                    seed = config["seed"] + 4 + 2 * round_
                    train_prompts += line_prompts(every, corpus.get("fresh_code_prompts", 0), length, tokenizer,
                                                  seed, distinct=True, avoid=earlier)
                    train_prompts += line_prompts(every, corpus.get("fresh_function_prompts", 0), length,
                                                  tokenizer, seed + 1, ends=DEF_LINE, distinct=True, avoid=earlier)
            if domain == "code" and corpus.get("extra_code_prompts", 0):
                # Line-end prompts after all of the above (gpu_run's --text-scale), none equal to one before, so
                # the config's own prompts, and the windows cached for them, stay as they are.
                seed = config["seed"] + 4 + 2 * corpus.get("fresh_code_rounds", 1)
                train_prompts += line_prompts(every, corpus["extra_code_prompts"], length, tokenizer, seed,
                                              distinct=True, avoid=list(train_prompts))
            out[domain] = (train_prompts, held_out_prompts)
        elif domain == "chat":
            def templated(questions):
                return [tokenizer.encode(chat_prompt(tokenizer, [{"role": "user", "content": q}]),
                                         add_special_tokens=False) for q in questions]

            questions = chat_prompts(held_out=False)
            if counts[domain] > len(questions):
                raise ValueError(f"corpus.prompts.chat={counts[domain]} is more than the {len(questions)} chat "
                                 "training prompts there are")
            out[domain] = (templated(questions[: counts[domain]]),
                           templated(chat_prompts(held_out=True)[:held_out_count]))
        else:
            raise ValueError(f"unknown corpus domain {domain!r}; choose from {', '.join(DOMAINS)}")
    return out


def rank_vocabulary(greedy: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every token id, most often predicted by the base model first (ties: lower id first)."""
    counts = torch.bincount(greedy.flatten(), minlength=vocab_size)
    return torch.argsort(-counts, stable=True)


def to_draft_ids(greedy: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token ids -> index in the draft vocabulary, IGNORE where the draft vocabulary lacks the token."""
    lookup = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    lookup[draft_vocab] = torch.arange(len(draft_vocab))
    return lookup[greedy]


def decoding_rows(ids: torch.Tensor, greedy: torch.Tensor, num_depths: int) -> list[torch.Tensor]:
    """Per depth m, [B, T - m]: whether row i's inputs are ones decoding can show. Depth m at row i reads the
    tokens at i+1..i+m, and while drafts are accepted each of those is the base model's own greedy choice, so
    the row counts only where ids[i + j] == greedy[i + j - 1] for every j in 1..m. A prompt's rows (text people
    wrote, a chat template) mostly fail that (docs/mtp-training.md, "The recipe"); the base model's continuation
    always passes."""
    chosen = ids[:, 1:] == greedy[:, :-1]
    rows, length = [chosen], ids.shape[1]
    for m in range(2, num_depths + 1):
        rows.append(rows[-1][:, : length - m] & chosen[:, m - 1:])
    return rows


class MtpTraining:
    """Everything the loop needs to train `num_modules` MTP modules on cached teacher outputs."""

    def __init__(self, base, base_config, config: dict, train: dict, held_out: dict[str, dict], ranking: torch.Tensor):
        self.base, self.config = base, config
        training = config["training"]
        self.batch_size = training["batch_size"]
        self.compute_dtype = dtype_named(config, "training", "compute_dtype")
        self.modules = mtp_layers(base_config, config["num_modules"])
        self.modules.apply(base._init_weights)
        self.device = base.get_output_embeddings().weight.device
        self.modules.to(self.device)
        vocab_size = base_config.vocab_size
        self.draft_vocab = ranking[: config["draft_vocab_size"]].sort().values
        head = base.get_output_embeddings().weight
        self.full_head = head
        self.draft_head = head[self.draft_vocab].clone()
        self.train = {key: value.to(self.device) for key, value in
                      {**train, "targets": to_draft_ids(train["greedy"], self.draft_vocab, vocab_size)}.items()}
        self.held_out = {domain: {key: value.to(self.device) for key, value in
                                  {**data, "targets": to_draft_ids(data["greedy"], self.draft_vocab, vocab_size)}.items()}
                         for domain, data in held_out.items()}
        self.draft_vocab, self.draft_head = self.draft_vocab.to(self.device), self.draft_head.to(self.device)

    def depth_hidden(self, ids: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
        return mtp_chain(self.modules, self.base.model.embed_tokens, self.base.model.rotary_emb, ids, hidden)

    def batch_losses(self, generator: torch.Generator) -> list[torch.Tensor]:
        """Cross-entropy to the base model's greedy token; with distill_fraction > 0, mixed with the KL divergence
        to the base model's own distribution over the draft vocabulary (its cached hidden state times the head).
        With training.loss_rows "decoding", only rows whose inputs decoding could show count (decoding_rows)."""
        index = torch.randint(0, len(self.train["ids"]), (self.batch_size,), generator=generator).to(self.device)
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            return self.losses_of(index)

    def losses_of(self, index: torch.Tensor) -> list[torch.Tensor]:
        ids, base_hidden = self.train["ids"][index], self.train["hidden"][index]
        depths = self.depth_hidden(ids, base_hidden)
        targets = self.train["targets"][index]
        training = self.config["training"]
        distill = training.get("distill_fraction", 0.0)
        counted = decoding_rows(ids, self.train["greedy"][index], len(depths)) \
            if training.get("loss_rows", "all") == "decoding" else None
        losses = []
        for m, h in enumerate(depths, start=1):
            logits = (h @ self.draft_head.t()).flatten(0, 1)
            depth_targets = targets[:, m:] if counted is None else targets[:, m:].masked_fill(~counted[m - 1], IGNORE)
            loss = F.cross_entropy(logits, depth_targets.flatten(), ignore_index=IGNORE)
            if distill > 0:
                with torch.no_grad():
                    teacher = (base_hidden[:, m:] @ self.draft_head.t()).flatten(0, 1).log_softmax(-1)
                kl = F.kl_div(logits.log_softmax(-1), teacher, log_target=True, reduction="none").sum(-1)
                kl = kl.mean() if counted is None else kl[counted[m - 1].flatten()].mean()
                loss = (1 - distill) * loss + distill * kl
            losses.append(loss)
        return losses

    @torch.no_grad()
    def evaluate(self, final: bool) -> dict:
        """Per held-out domain and depth, teacher-forced: cross-entropy over the draft vocabulary, and how often the
        draft's top token equals the base model's greedy token, with the draft head and with the full head, and
        with the draft head on decoding_rows alone (the prompt's rows left out: what drafting meets).
        chain_accepted: the mean number of leading depths that all agree, what greedy speculation would accept."""
        limit = None if final else self.config["training"]["eval_windows"]
        report = {"loss": [0.0] * len(self.modules), "domains": {}}
        for domain, data in self.held_out.items():
            ids, hidden, greedy, targets = (data[key][:limit] for key in ("ids", "hidden", "greedy", "targets"))
            losses, agree_draft, agree_full, agree_decoding, chain, chain_total = [], [], [], [], None, 0.0
            common_rows = ids.shape[1] - len(self.modules)
            decoding = decoding_rows(ids, greedy, len(self.modules))
            for m, h in enumerate(self.depth_hidden(ids, hidden), start=1):
                logits = h @ self.draft_head.t()
                losses.append(F.cross_entropy(logits.flatten(0, 1), targets[:, m:].flatten(), ignore_index=IGNORE).item())
                draft_match = self.draft_vocab[logits.argmax(-1)] == greedy[:, m:]
                agree_draft.append(draft_match.float().mean().item())
                agree_decoding.append(draft_match[decoding[m - 1]].float().mean().item())
                agree_full.append(((h @ self.full_head.t()).argmax(-1) == greedy[:, m:]).float().mean().item())
                chain = draft_match[:, :common_rows] if chain is None else chain & draft_match[:, :common_rows]
                chain_total += chain.float().mean().item()
            report["domains"][domain] = {
                "loss": losses, "agreement_draft_head": agree_draft, "agreement_full_head": agree_full,
                "agreement_draft_head_decoding_rows": agree_decoding,
                "chain_accepted": chain_total, "draft_vocab_covers_greedy": (targets != IGNORE).float().mean().item(),
            }
            report["loss"] = [a + b / len(self.held_out) for a, b in zip(report["loss"], losses)]
        return report

    def export(self, output_dir: Path, step: int, log: dict) -> None:
        state = {key: value.detach().cpu().contiguous() for key, value in
                 export_mtp_state_dict(self.modules, self.base.config.num_hidden_layers).items()}
        state["d2t"] = log["_ranking"].cpu()
        staging = output_dir.parent / (output_dir.name + ".staging")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        save_weights(state, staging, {"format": "pt", "trained_by": "compiled-spec train-mtp", "step": str(step)},
                     self.config.get("max_file_bytes"))
        public_log = {k: v for k, v in log.items() if not k.startswith("_")}
        (staging / MTP_CONFIG_NAME).write_text(json.dumps(self.config, indent=2) + "\n")
        (staging / "training_log.json").write_text(json.dumps(public_log, indent=2) + "\n")
        names = [f"MTP depth {m}" for m in range(1, len(self.modules) + 1)]
        loop.plot_loss_curve(log["history"], staging / "loss_curve.png", names, f"MTP modules on {self.config['model']}",
                             ylabel="cross-entropy to the base model's greedy token")
        output_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*output_dir.glob(MTP_WEIGHTS_NAME), *output_dir.glob("mtp-*-of-*.safetensors")]:
            stale.unlink()  # a weights file of an earlier export: the engine reads every *.safetensors here
        for path in staging.iterdir():
            os.replace(path, output_dir / path.name)
        staging.rmdir()


def save_weights(state: dict[str, torch.Tensor], directory: Path, metadata: dict, max_file_bytes: int | None) -> list[Path]:
    """mtp.safetensors; with max_file_bytes, as many mtp-0000i-of-0000n.safetensors as keep each file under it
    (tensors in name order, each whole). The engine reads every *.safetensors in an MTP directory."""
    if max_file_bytes is None:
        save_file(state, str(directory / MTP_WEIGHTS_NAME), metadata=metadata)
        return [directory / MTP_WEIGHTS_NAME]
    groups, size = [[]], 0
    for name in sorted(state):
        tensor_bytes = state[name].numel() * state[name].element_size() + 256  # with its header entry
        if tensor_bytes > max_file_bytes - (1 << 12):
            raise ValueError(f"{name} alone is {tensor_bytes} bytes, over the {max_file_bytes}-byte file limit")
        if groups[-1] and size + tensor_bytes > max_file_bytes - (1 << 12):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += tensor_bytes
    paths = []
    for number, names in enumerate(groups, start=1):
        path = directory / f"mtp-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file({name: state[name] for name in names}, str(path), metadata=metadata)
        paths.append(path)
    return paths


def self_generated_data(config: dict, base, tokenizer, base_path: Path, work_dir: Path) -> tuple[dict, dict, dict, dict]:
    """The training windows of every domain in one set (domain order), the held-out windows by domain, the training
    tokens by domain, and the data's provenance record for the training log; from shards in
    work_dir/shards/<domain>_<split> made as corpus.generate_dtype says. Every shard is made first and the training
    windows read afterwards into tensors allocated once, so the corpus is in memory once."""
    corpus, length = config["corpus"], config["training"]["sequence_length"]
    shard_windows = corpus.get("shard_windows", 32)
    dtype = dtype_named(config, "corpus", "generate_dtype")
    generating = base if dtype == torch.float32 else copy.deepcopy(base).to(dtype)
    generation = {"base_model_sha256": checkpoint_digest(base_path), "seed": config["seed"],
                  "dtype": str(dtype).removeprefix("torch.")}
    train_dirs, train_records, train_tokens, held_out, sets = [], [], {}, {}, {}
    for domain, (train_prompts, held_out_prompts) in domain_prompts(config, tokenizer, work_dir).items():
        for split, prompts in (("train", train_prompts), ("held_out", held_out_prompts)):
            shard_dir = work_dir / "shards" / f"{domain}_{split}"
            records = self_generated_shards(
                generating, prompts, length, corpus["generate_batch_size"], shard_dir,
                f"base model continues {domain} prompts ({split.replace('_', ' ')})", generation, shard_windows)
            windows = sum(r["windows"] for r in records)
            if split == "train":
                train_dirs.append(shard_dir)
                train_records.append(records)
                train_tokens[domain] = windows * length
            else:
                held_out[domain] = load_shards([shard_dir], [records], length)
            sets[f"{domain}_{split}"] = {
                "shards": len(records), "windows": windows,
                "seeds": sorted({r["seed"] for r in records}), "records_sha256": records_digest(records)}
    del generating
    train = load_shards(train_dirs, train_records, length)
    provenance = {"base_model": {"path": str(base_path), "sha256": generation["base_model_sha256"]},
                  "dtype": generation["dtype"], "sequence_length": length, "shard_windows": shard_windows,
                  "generate_batch_size": generation_batch(corpus["generate_batch_size"], shard_windows), "sets": sets}
    return train, held_out, train_tokens, provenance


def train_mtp(config: dict, resume: bool = False, measure_steps: int | None = None) -> dict:
    training = config["training"]
    if training.get("loss_rows", "all") not in ("all", "decoding"):
        raise ValueError(f"training.loss_rows is {training['loss_rows']!r}; choose all or decoding")
    dtype_named(config, "training", "compute_dtype")
    dtype_named(config, "corpus", "generate_dtype")
    work_dir, output_dir = loop.prepare(config)
    base_path = resolve_model(config["model"])
    base, base_config = load_base(base_path)
    base.to(config.get("device", "cpu"))
    tokenizer = load_tokenizer(base_path)
    train, held_out, train_tokens, provenance = self_generated_data(config, base, tokenizer, base_path, work_dir)
    ranking = rank_vocabulary(train["greedy"], base_config.vocab_size)
    torch.manual_seed(config["seed"])  # module init does not depend on how the teacher cache was made
    task_state = MtpTraining(base, base_config, config, train, held_out, ranking)
    log = {
        "config": config,
        "parameters_per_module": sum(p.numel() for p in task_state.modules[0].parameters()),
        "train_tokens": train_tokens,
        "held_out_tokens": {d: int(p["ids"].numel()) for d, p in held_out.items()},
        "history": {"train": [], "validation": []},
        "data_provenance": provenance,
    }
    task = loop.Task(
        model=task_state.modules,
        batch_losses=task_state.batch_losses,
        loss_weights=(training["loss_weights"] * config["num_modules"])[: config["num_modules"]]
        if len(training["loss_weights"]) == 1 else training["loss_weights"][: config["num_modules"]],
        evaluate=task_state.evaluate,
        export=lambda step, log: task_state.export(output_dir, step, {**log, "_ranking": ranking.to(torch.int32)}),
        depth_names=[f"depth {m}" for m in range(1, config["num_modules"] + 1)],
        title=f"MTP modules on {config['model']}",
    )
    return loop.run(task, training, config, work_dir, log, resume, measure_steps)


def load_config(path: Path | None, overrides: dict) -> dict:
    config = copy.deepcopy(json.loads(Path(path or DEFAULT_CONFIG).read_text()))
    if overrides.get("model") is not None:
        # Another base model gets folders of its own, so it never reuses or overwrites the config's.
        stem = Path(str(overrides["model"])).stem
        overrides = {"work_dir": str(Path(".train_mtp_work") / stem), "output_dir": f"mtp_{stem}",
                     **{k: v for k, v in overrides.items() if v is not None}}
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "domains":
            config["corpus"]["domains"] = value
        elif key == "max_steps":
            config["training"]["max_steps"] = value
        else:
            config[key] = value
    return config
