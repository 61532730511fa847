"""MTP training data that looks like decoding: prompts followed by the base model's own greedy continuation.

When the engine drafts, every token the MTP module sees is one the base model chose itself, so the module's two
inputs agree (the token after row i is the argmax of the base model's hidden state at row i). Text written by
people breaks that at about half of its rows. Here the base model continues each prompt greedily, and every row
keeps what decoding would show the modules: the token, the base model's post-norm hidden state and its greedy
prediction. One pass makes all three, so no second teacher pass is needed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from .loop import save_atomically


@torch.no_grad()
def continue_batch(base, prompts: list[list[int]], length: int) -> dict[str, torch.Tensor]:
    """Each prompt (shorter than `length`) continued greedily to `length` tokens, in one left-padded batch.

    Returns ids [B, length], hidden [B, length, H] (post-norm, the row's own) and greedy [B, length] (the base
    model's argmax after each row: the next id wherever the base model wrote it).
    """
    from transformers import StaticCache

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
    ids, hidden, greedy = torch.cat(all_ids, 1), torch.cat(all_hidden, 1), torch.cat(all_greedy, 1)
    # Row r's text starts after its padding: keep `length` columns from there.
    columns = (widest - lengths)[:, None] + torch.arange(length)[None, :]
    return {"ids": ids.gather(1, columns), "greedy": greedy.gather(1, columns),
            "hidden": hidden.gather(1, columns[:, :, None].expand(-1, -1, hidden.shape[-1]))}


def self_generated_windows(base, prompts: list[list[int]], length: int, batch_size: int, cache_file: Path,
                           description: str, base_key: str) -> dict[str, torch.Tensor]:
    """continue_batch over every prompt, saved to cache_file after each batch. A cache that starts with the same
    prompts (a run that stopped, a corpus that grew or shrank) is kept and only the rest is generated. Longer
    cached windows are cut to `length`: each row depends only on the rows before it, so that is what generating
    to `length` gives (the file keeps them long until a new prompt is added). One made with another base model
    (base_key) or shorter windows starts over."""
    longest = max((len(prompt) for prompt in prompts), default=0)
    if not 0 < longest < length:
        raise ValueError(f"{description}: prompts of up to {longest} tokens need windows longer than that; "
                         f"training.sequence_length is {length}")
    done: dict[str, torch.Tensor] | None = None
    known: list[list[int]] = []
    if cache_file.is_file():
        cached = torch.load(cache_file, weights_only=True)
        known = cached["prompts"][: len(prompts)]
        if cached["base"] == base_key and cached["length"] >= length and prompts[: len(known)] == known:
            done = {key: cached[key][: len(known), :length] for key in ("ids", "hidden", "greedy")}
            if cached["length"] > length:
                done["hidden"] = done["hidden"].clone()  # saved alone, not as a view of the longer windows
        else:
            known = []
    with tqdm(total=len(prompts), initial=len(known), desc=description, unit="prompt") as bar:
        for first in range(len(known), len(prompts), batch_size):
            part = continue_batch(base, prompts[first: first + batch_size], length)
            done = part if done is None else {key: torch.cat([done[key], part[key]]) for key in done}
            known = prompts[: first + len(part["ids"])]
            save_atomically({**done, "prompts": known, "length": length, "base": base_key}, cache_file)
            bar.update(len(part["ids"]))
    return done
