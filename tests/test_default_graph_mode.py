from compiled_spec import LLM, GraphMode


def test_full_is_the_default_where_graphs_are_replayed_and_eager_on_cpu(tiny_checkpoint):
    assert GraphMode.default_for("cuda") == GraphMode.FULL
    assert GraphMode.default_for("cuda:1") == GraphMode.FULL
    assert GraphMode.default_for("cpu") == GraphMode.EAGER
    llm = LLM(tiny_checkpoint("predictive").path, max_seq_len=32)
    assert llm.config.graph_mode == GraphMode.EAGER
    assert LLM(tiny_checkpoint("predictive").path, max_seq_len=32, graph_mode="full", warm_up=False).config.graph_mode == GraphMode.FULL
