"""MTP training data that looks like decoding: prompts followed by the base model's own greedy continuation.

When the engine drafts, every token the MTP module sees is one the base model chose itself, so the module's two
inputs agree (the token after row i is the argmax of the base model's hidden state at row i). Text written by
people breaks that at about half of its rows. Here the base model continues each prompt greedily, and every row
keeps what decoding would show the modules: the token, the base model's post-norm hidden state and its greedy
prediction. One pass makes all three, so no second teacher pass is needed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..loading.registry import sha256_of

SHARD_LIMIT_BYTES = 16 << 20  # what a device run can bring back in one file
# Settings a shard must share with the run that reads it; its seed is recorded but not compared (it only chooses
# prompts, which prompts_sha256 covers).
COMPARED = ("base_model_sha256", "prompts_sha256", "windows", "generate_batch_size", "dtype")


@torch.no_grad()
def continue_batch(base, prompts: list[list[int]], length: int) -> dict[str, torch.Tensor]:
    """Each prompt (shorter than `length`) continued greedily to `length` tokens, in one left-padded batch.

    Returns ids [B, length], hidden [B, length, H] (post-norm, the row's own) and greedy [B, length] (the base
    model's argmax after each row: the next id wherever the base model wrote it), on the CPU, hidden in float32
    whatever dtype the base model computes in.
    """
    from transformers import StaticCache

    device = base.get_output_embeddings().weight.device
    lengths = torch.tensor([len(p) for p in prompts])
    if int(lengths.min()) < 1 or int(lengths.max()) >= length:
        raise ValueError(f"prompt lengths must be 1..{length - 1} tokens, got {lengths.min()}..{lengths.max()}")
    batch, widest = len(prompts), int(lengths.max())
    ids = torch.zeros(batch, widest, dtype=torch.long)
    mask = torch.zeros(batch, widest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, widest - len(prompt):] = torch.tensor(prompt)
        mask[row, widest - len(prompt):] = 1
    steps = length - int(lengths.min())
    cache = StaticCache(config=base.config, max_cache_len=widest + steps)
    head = base.get_output_embeddings().weight
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    all_ids, all_hidden, all_greedy = [ids], [], []
    token_ids = ids
    for step in range(steps + 1):
        out = base.model(input_ids=token_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        hidden = out.last_hidden_state
        # The head in blocks of rows: one product of a whole prefill would not fit in memory.
        rows = hidden.flatten(0, 1)
        greedy = torch.cat([(block @ head.t()).argmax(-1) for block in rows.split(2048)]).view(hidden.shape[:2])
        all_hidden.append(hidden)
        all_greedy.append(greedy)
        if step == steps:
            break
        token_ids = greedy[:, -1:]
        all_ids.append(token_ids)
        mask = torch.cat([mask, torch.ones_like(token_ids)], dim=1)
        positions = positions[:, -1:] + 1
    ids, hidden, greedy = torch.cat(all_ids, 1).cpu(), torch.cat(all_hidden, 1).float().cpu(), torch.cat(all_greedy, 1).cpu()
    # Row r's text starts after its padding: keep `length` columns from there.
    columns = (widest - lengths)[:, None] + torch.arange(length)[None, :]
    return {"ids": ids.gather(1, columns), "greedy": greedy.gather(1, columns),
            "hidden": hidden.gather(1, columns[:, :, None].expand(-1, -1, hidden.shape[-1]))}


def generation_batch(batch_size: int, shard_windows: int) -> int:
    """Prompts a batch of generation: batch_size rounded down to whole shards, at least one."""
    return max(1, batch_size // shard_windows) * shard_windows


def checkpoint_digest(path: Path) -> str:
    """sha256 of a .gguf file; of a checkpoint directory, sha256 over its config.json and *.safetensors files'
    names and digests."""
    if path.is_file():
        return sha256_of(path)
    files = sorted([*path.glob("*.safetensors"), *path.glob("config.json")])
    return hashlib.sha256(json.dumps([[f.name, sha256_of(f)] for f in files]).encode()).hexdigest()


def prompts_digest(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts, separators=(",", ":")).encode()).hexdigest()


def records_digest(records: list[dict]) -> str:
    return hashlib.sha256(json.dumps(records, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def shard_mismatch(record: dict, wanted: dict) -> str | None:
    """Why a shard's record does not fit the shard wanted now, or None when it does (longer windows fit)."""
    for key in COMPARED:
        if record.get(key) != wanted[key]:
            return f"{key} is {record.get(key)!r}, this run's is {wanted[key]!r}"
    if record.get("length", 0) < wanted["length"]:
        return f"its windows are {record.get('length')} tokens, this run's are {wanted['length']}"
    return None


KEYS = ("ids", "hidden", "greedy")


def shard_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        return {key: handle.get_tensor(key) for key in KEYS}


def shard_record(path: Path) -> dict:
    """A shard's provenance record, read without its tensors; raises if the file is not a whole shard (safetensors
    checks the header against the file's size) or its tensors do not hold the record's windows."""
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        record = json.loads(handle.metadata()["provenance"])
        shapes = {key: handle.get_slice(key).get_shape() for key in KEYS}
    if any(shape[0] != record["windows"] for shape in shapes.values()):
        raise ValueError(f"its tensors hold {shapes} rows, its record says {record['windows']} windows")
    return record


def self_generated_shards(base, prompts: list[list[int]], length: int, batch_size: int, shard_dir: Path,
                          description: str, generation: dict, shard_windows: int) -> list[dict]:
    """continue_batch over every prompt, kept in shard_dir as shards of shard_windows windows (safetensors, at
    most 16 MiB each), each with its provenance record: generation (base_model_sha256, seed, dtype), the shard's
    index, windows, length and prompts_sha256 (sha256 of its prompts' token ids). Returns the shards' records;
    load_shards reads them.

    Prompts go to the base model in batches of whole shards (batch_size rounded down to a multiple of
    shard_windows, at least one shard), always the same batches for the same prompts: a rerun, or a run stopped
    part way, generates only the shards that are missing and the data is bitwise what one uninterrupted run makes.
    A shard is written under a temporary name and renamed when whole. A shard made for other prompts (a corpus
    that grew: its last shard), another base model, batch size or dtype is regenerated, and the reason printed.
    No window is held in memory past its batch, so a corpus larger than memory can be generated."""
    longest = max((len(prompt) for prompt in prompts), default=0)
    if not 0 < longest < length:
        raise ValueError(f"{description}: prompts of up to {longest} tokens need windows longer than that; "
                         f"training.sequence_length is {length}")
    window_bytes = length * (base.config.hidden_size * 4 + 2 * 8)
    if shard_windows * window_bytes > SHARD_LIMIT_BYTES - (1 << 16):
        raise ValueError(f"corpus.shard_windows={shard_windows} windows of {length} tokens are "
                         f"{shard_windows * window_bytes / 2**20:.1f} MiB a shard, over 16 MiB; at most "
                         f"{(SHARD_LIMIT_BYTES - (1 << 16)) // window_bytes}")
    generation = {**generation, "generate_batch_size": generation_batch(batch_size, shard_windows)}
    shards_per_batch = generation["generate_batch_size"] // shard_windows
    shard_dir.mkdir(parents=True, exist_ok=True)
    num_shards = -(-len(prompts) // shard_windows)
    records = [None] * num_shards
    with tqdm(total=len(prompts), desc=description, unit="prompt") as bar:
        for first_shard in range(0, num_shards, shards_per_batch):
            batch = range(first_shard, min(first_shard + shards_per_batch, num_shards))
            wanted = {}
            for index in batch:
                shard_prompts = prompts[index * shard_windows: (index + 1) * shard_windows]
                wanted[index] = {**generation, "shard": index, "windows": len(shard_prompts), "length": length,
                                 "prompts_sha256": prompts_digest(shard_prompts)}
                path = shard_dir / f"{index:05d}.safetensors"
                if not path.is_file():
                    continue
                try:
                    record = shard_record(path)
                except Exception as error:  # noqa: BLE001 - safetensors raises several types for a bad file
                    tqdm.write(f"{path}: unreadable ({error}); regenerating it")
                    continue
                reason = shard_mismatch(record, wanted[index])
                if reason:
                    tqdm.write(f"{path}: made for other data ({reason}); regenerating it")
                    continue
                records[index] = record
                bar.update(record["windows"])
            missing = [index for index in batch if records[index] is None]
            if not missing:
                continue
            first, last = batch[0] * shard_windows, (batch[-1] + 1) * shard_windows
            made = continue_batch(base, prompts[first:last], length)
            for index in missing:
                rows = slice(index * shard_windows - first, (index + 1) * shard_windows - first)
                part = {key: value[rows].contiguous() for key, value in made.items()}
                path = shard_dir / f"{index:05d}.safetensors"
                temporary = path.with_suffix(".tmp")
                save_file(part, str(temporary), metadata={"provenance": json.dumps(wanted[index])})
                os.replace(temporary, path)
                records[index] = wanted[index]
                bar.update(wanted[index]["windows"])
    return records


def load_shards(shard_dirs: list[Path], records: list[list[dict]], length: int) -> dict[str, torch.Tensor]:
    """The windows of every shard that records name, directory by directory, cut to `length` tokens (each row
    depends only on the rows before it), read into one tensor per key allocated once: the corpus is in memory
    once, never twice."""
    shards = [(directory / f"{record['shard']:05d}.safetensors", record)
              for directory, dir_records in zip(shard_dirs, records) for record in dir_records]
    if not shards:
        return {}
    total = sum(record["windows"] for _, record in shards)
    data, row = None, 0
    for path, record in shards:
        part = shard_tensors(path)
        if data is None:
            data = {key: torch.empty((total, length, *value.shape[2:]), dtype=value.dtype)
                    for key, value in part.items()}
        for key, value in part.items():
            data[key][row: row + record["windows"]] = value[:, :length]
        row += record["windows"]
    return data


def self_generated_windows(base, prompts: list[list[int]], length: int, batch_size: int, shard_dir: Path,
                           description: str, generation: dict, shard_windows: int) -> tuple[dict, list[dict]]:
    """self_generated_shards, then its windows: ({ids, hidden, greedy} over every prompt, the records)."""
    records = self_generated_shards(base, prompts, length, batch_size, shard_dir, description, generation,
                                    shard_windows)
    return load_shards([shard_dir], [records], length), records
