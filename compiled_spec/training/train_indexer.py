"""Trains lightning-indexer weights for a checkpoint by KL to its own dense attention.

    python -m compiled_spec.training.train_indexer [--model DIR] [--heads 4] [--dim 32] [--steps 300] [--init keys]

The embedded model's indexer.safetensors came from `--init keys --steps 400`.

DeepSeek-V3.2's indexer warm-up, on CPU: the model is frozen; for every attention layer (main layers
and MTP modules) the indexer's distribution softmax_s I(t, s) over s <= t is fitted to the layer's
dense attention, summed over heads and renormalised: loss = KL(p_dense || softmax(I)). Training text
is the default model's training corpus (the plays it was not validated on). Reports, per layer, how
much of the dense attention mass the top-k tokens of the trained indexer and of the training-free
KeyScorer capture on held-out plays, and writes DIR/indexer.safetensors (keys beside each layer's
own attention weights, `<layer>.self_attn.indexer.*`, in the checkpoint's MTP layout), which
HiSparseConfig(scorer="auto") loads.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..api import DEFAULT_MODEL, LLM
from ..hisparse.indexer import LightningIndexer, attention_modules
from ..loading.checkpoint import MAIN_KEY, mtp_target, safetensors_files
from ..model.rope import apply_rotary
from ..speculative.state import DecodeState
from ..speculative.step import StepConstants, make_layout
from .corpus import fetch_texts_dir, read_works

WORK_DIR = Path(".train_work")
HELD_OUT = ("macbeth", "twelfth_night", "julius_caesar")


def checkpoint_prefixes(path: Path, num_layers: int) -> dict[str, str]:
    """Our attention prefix ('layers.0', 'mtp.1.block') -> the checkpoint's ('model.layers.0', 'model.layers.7')."""
    out = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                if not key.endswith(".self_attn.q_proj.weight"):
                    continue
                raw = key[: -len(".self_attn.q_proj.weight")]
                main = MAIN_KEY.match(key)
                if main and main["layer"] is not None and int(main["layer"]) < num_layers:
                    out[f"layers.{main['layer']}"] = raw
                elif (target := mtp_target(key, num_layers)) is not None:
                    out[f"mtp.{target[1]}.block"] = raw
    return out


def windows(llm: LLM, texts: list[str], count: int, length: int, seed: int) -> torch.Tensor:
    ids = torch.tensor(llm.tokenizer.encode("".join(texts), add_special_tokens=False))
    starts = torch.randint(0, len(ids) - length, (count,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([ids[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def capture(llm: LLM, tokens: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """Per attention prefix: inputs x [N, T, H], rotary tables, and the dense attention p [N, T, T] (heads summed)."""
    model, length = llm.model, tokens.shape[1]
    captured: dict[str, dict[str, list]] = {}
    hooks = []
    for prefix, attention in attention_modules(model).items():
        def hook(module, args, prefix=prefix):
            x, layout = args[0], args[1]
            batch, width, _ = x.shape
            q = module.q_proj(x).view(batch, width, module.num_heads, module.head_dim)
            k = module.k_proj(x).view(batch, width, module.num_kv_heads, module.head_dim)
            if module.q_norm is not None:
                q, k = module.q_norm(q), module.k_norm(k)
            q, k = apply_rotary(q, layout.cos, layout.sin), apply_rotary(k, layout.cos, layout.sin)
            k = k.repeat_interleave(module.num_heads // module.num_kv_heads, dim=2)
            logits = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * module.head_dim**-0.5
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            probs = logits.masked_fill(~causal, float("-inf")).softmax(-1).sum(1)
            entry = captured.setdefault(prefix, {"x": [], "cos": [], "sin": [], "p": []})
            for name, value in (("x", x), ("cos", layout.cos), ("sin", layout.sin), ("p", probs / probs.sum(-1, keepdim=True))):
                entry[name].append(value.float())
        hooks.append(attention.register_forward_pre_hook(hook))
    try:
        for row in tokens:
            ids = row[None]
            for depth in range(0, len(model.mtp) + 1):
                width = length - depth
                state = DecodeState.allocate(model.config, 1, length + 1, 1, torch.float32, "cpu")
                cos, sin = llm.engine.constants.rope_cos, llm.engine.constants.rope_sin
                constants = StepConstants(cos, sin, torch.zeros(0, dtype=torch.int64), length + 1)
                positions = torch.arange(width)[None]
                layout = make_layout(state, constants, torch.zeros(1, dtype=torch.int64), positions,
                                     torch.ones_like(positions, dtype=torch.bool), False)
                if depth == 0:
                    hidden = model.hidden_states(ids, layout, state.main_keys, state.main_values)
                else:
                    hidden = model.mtp_hidden_states(depth, ids[:, depth:], hidden[:, :width], layout,
                                                     state.draft_keys[0], state.draft_values[0])
    finally:
        for hook in hooks:
            hook.remove()
    return {prefix: {name: torch.cat(values) for name, values in entry.items()} for prefix, entry in captured.items()}


@torch.no_grad()
def indexer_like_key_scorer(attention) -> LightningIndexer:
    """An indexer whose q/k projections are the layer's own query heads and KV-head-mean key, so training
    starts where the training-free scorer is (up to the head weights, which start small and random)."""
    if attention.q_norm is not None:
        raise ValueError("--init keys needs a layer without q/k norm")
    hidden = attention.q_proj.in_features
    indexer = LightningIndexer(hidden, attention.num_heads, attention.head_dim)
    indexer.wq.weight.copy_(attention.q_proj.weight)
    indexer.wk.weight.copy_(attention.k_proj.weight.view(attention.num_kv_heads, attention.head_dim, hidden).mean(0))
    return indexer


def indexer_scores(indexer: LightningIndexer, x, cos, sin) -> torch.Tensor:
    batch, length, _ = x.shape
    q = indexer.wq(x).view(batch, length, indexer.num_heads, indexer.head_dim)
    k = indexer.wk(x).view(batch, length, 1, indexer.head_dim)
    if indexer.head_dim >= cos.shape[-1]:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    weights = indexer.weights_proj(x) * (indexer.num_heads * indexer.head_dim) ** -0.5
    return (torch.einsum("bthd,bsd->bths", q, k[:, :, 0]).relu() * weights[..., None]).sum(2)


def key_scores(attention, x, cos, sin) -> torch.Tensor:
    """The training-free KeyScorer's I(t, s)."""
    batch, length, _ = x.shape
    q = attention.q_proj(x).view(batch, length, attention.num_heads, attention.head_dim)
    k = attention.k_proj(x).view(batch, length, attention.num_kv_heads, attention.head_dim)
    if attention.q_norm is not None:
        q, k = attention.q_norm(q), attention.k_norm(k)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return torch.einsum("bthd,bsd->bths", q, k.mean(2)).relu().sum(2)


def kl_loss(scores, target) -> torch.Tensor:
    causal = torch.ones(scores.shape[-1], scores.shape[-1], dtype=torch.bool).tril()
    log_q = scores.masked_fill(~causal, float("-inf")).log_softmax(-1).masked_fill(~causal, 0.0)
    return (target * (target.clamp(min=1e-12).log() - log_q)).sum(-1).mean()


def recall(scores, target, top_k: int) -> float:
    """Mean fraction of the dense attention mass on each query's top_k tokens (queries past position top_k)."""
    causal = torch.ones(scores.shape[-1], scores.shape[-1], dtype=torch.bool).tril()
    chosen = scores.masked_fill(~causal, float("-inf")).topk(top_k, dim=-1).indices
    return target.gather(-1, chosen).sum(-1)[:, top_k:].mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sequences", type=int, default=48)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", choices=("random", "keys"), default="random",
                        help="keys: start from the key scorer (the layer's query heads and KV-mean key; "
                             "--heads/--dim are then the layer's own)")
    parser.add_argument("--out", default=None, help="default: MODEL/indexer.safetensors")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    llm = LLM(args.model, num_speculative_tokens=1, max_seq_len=args.length + 1, warm_up=False)
    works = read_works(fetch_texts_dir(WORK_DIR))
    train = capture(llm, windows(llm, [t for n, t in works.items() if n not in HELD_OUT], args.sequences, args.length, 1))
    held_out = capture(llm, windows(llm, [works[n] for n in HELD_OUT], 16, args.length, 2))

    prefixes = checkpoint_prefixes(Path(args.model), llm.model_config.num_hidden_layers)
    modules = attention_modules(llm.model)
    weights, report = {}, {}
    for prefix, data in train.items():
        start = time.perf_counter()
        if args.init == "keys":
            indexer = indexer_like_key_scorer(modules[prefix])
        else:
            indexer = LightningIndexer(llm.model_config.hidden_size, args.heads, args.dim)
        optimizer = torch.optim.AdamW(indexer.parameters(), lr=args.lr, weight_decay=0.0)
        for step in range(args.steps):
            batch = torch.randint(0, data["x"].shape[0], (args.batch,))
            loss = kl_loss(indexer_scores(indexer, data["x"][batch], data["cos"][batch], data["sin"][batch]), data["p"][batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        test = held_out[prefix]
        with torch.no_grad():
            trained = indexer_scores(indexer, test["x"], test["cos"], test["sin"])
            free = key_scores(modules[prefix], test["x"], test["cos"], test["sin"])
            report[prefix] = {
                "held_out_kl": kl_loss(trained, test["p"]).item(),
                **{f"recall@{k}": {"indexer": recall(trained, test["p"], k), "keys": recall(free, test["p"], k)}
                   for k in (16, 32, 64)},
            }
        print(f"{prefix}: KL {report[prefix]['held_out_kl']:.3f}, mass in top-32: indexer "
              f"{report[prefix]['recall@32']['indexer']:.1%}, key scorer {report[prefix]['recall@32']['keys']:.1%} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        for name, tensor in indexer.state_dict().items():
            weights[f"{prefixes[prefix]}.self_attn.indexer.{name}"] = tensor.detach().contiguous()
    out = Path(args.out) if args.out else Path(args.model) / "indexer.safetensors"
    save_file(weights, str(out), metadata={"format": "pt", "trained_by": "compiled_spec.training.train_indexer",
                                           "arguments": json.dumps(vars(args)), "held_out": json.dumps(report)})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
