"""The lightning indexer shipped with the embedded model: it loads for every attention layer, MTP modules
included, and on held-out text (Macbeth I.3; Macbeth was left out of training) the tokens it ranks highest
carry more of dense attention's mass than the training-free key scorer's picks do."""

from pathlib import Path

import torch

from compiled_spec import LLM, HiSparseConfig
from compiled_spec.hisparse.indexer import LightningIndexer, attention_modules
from compiled_spec.training.train_indexer import capture, indexer_scores, key_scores, recall

HELD_OUT_TEXT = Path(__file__).parent / "data" / "macbeth_1_3.txt"
WINDOW = 256


def test_embedded_indexer_beats_the_key_scorer_on_held_out_text():
    llm = LLM(num_speculative_tokens=1, max_seq_len=WINDOW + 1, warm_up=False,
              hisparse=HiSparseConfig(scorer="indexer"))
    modules = attention_modules(llm.model)
    assert len(modules) == 8  # 6 main layers and 2 MTP modules
    assert all(isinstance(attention.indexer, LightningIndexer) for attention in modules.values())

    ids = torch.tensor(llm.tokenizer.encode(HELD_OUT_TEXT.read_text(), add_special_tokens=False))
    windows = ids[: len(ids) // WINDOW * WINDOW].view(-1, WINDOW)
    assert len(windows) >= 3
    gains = {}
    for prefix, data in capture(llm, windows).items():
        attention = modules[prefix]
        with torch.no_grad():
            trained = indexer_scores(attention.indexer, data["x"], data["cos"], data["sin"])
            free = key_scores(attention, data["x"], data["cos"], data["sin"])
        gains[prefix] = {k: recall(trained, data["p"], k) - recall(free, data["p"], k) for k in (16, 32)}
    assert all(gain > 0 for by_k in gains.values() for gain in by_k.values()), gains
