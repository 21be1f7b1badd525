"""ragattn.methods.registry: the one method list read by demo, eval, the benchmarks and vLLM."""
import pytest

from ragattn.methods import registry


def test_names_spellings_and_flags():
    names = registry.names()
    assert len(names) == len(set(names)) and names[0] == registry.BASELINE
    assert registry.get("block_attention").name == registry.canonical("block-attention") == "block-attention"
    assert registry.canonical("full") == registry.BASELINE
    assert registry.find("cache-blend") is None and registry.find(None) is None
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        registry.get("nope")
    with pytest.raises(ValueError, match="known: cacheblend, fusionrag"):
        registry.get("rapid", among=registry.names(served=True, ratio=True))
    assert registry.names(served=True, ratio=True) == ("cacheblend", "fusionrag")
    assert set(registry.names(served=True)) == {"block-attention", "turborag-reordered", "turborag-composite",
                                                "cacheblend", "fusionrag"}
    assert registry.SERVED_DEFAULT in registry.names(served=True)
    assert "refrag" in registry.names(demo=True) and "refrag" not in registry.names(evaluated=True)


def test_check_ratio():
    assert registry.check_ratio(0) is None and registry.check_ratio(1.0) is None
    for bad in (-0.1, 1.5, float("nan"), True, "0.1", None):
        assert "must be a number in [0, 1]" in registry.check_ratio(bad)


def test_readers_take_the_registry():
    from ragattn.apps import demo, eval as ev
    from ragattn.vllm import spans

    assert demo.METHOD_NAMES == list(registry.names(demo=True))
    assert [m.name for m in ev.REGISTRY] == list(registry.names(evaluated=True))
    assert spans.METHODS == registry.names(served=True) and spans.DEFAULT_RATIO == registry.DEFAULT_RATIO
    assert spans.method_from_params({"ragattn_method": "turborag_composite"}).name == "turborag-composite"
    assert ev.parse_args(["--methods", "block_attention"]).methods == [registry.BASELINE, "block-attention"]


def test_served_bench_rows():
    from bench import served_memory, served_methods

    s = [[0, 4], [4, 9]]
    assert {k: f(s) for k, f in served_methods.METHODS.items()} == {
        "full": None, "block_attention": {"ragattn_spans": s},
        "turborag_composite": {"ragattn_spans": s, "ragattn_method": "turborag-composite"},
        "cacheblend": {"ragattn_spans": s, "ragattn_method": "cacheblend", "ragattn_ratio": 0.15},
        "fusionrag": {"ragattn_spans": s, "ragattn_method": "fusionrag", "ragattn_ratio": 0.15}}
    assert served_methods.RAGATTN_ONLY == ("cacheblend", "fusionrag")
    assert served_memory.METHODS == ("block_attention", "fusionrag")


def _record(model, tokenizer, chunks, question, **kw):
    """An answer function that returns what it was called with (for Method.call's dispatch)."""
    return (model, tokenizer, chunks, question, kw)


def test_call_passes_options_store_and_ratio():
    rec = registry.Method("rec", __name__, "_record", (("positions", "composite"),))
    rec_ratio = registry.Method("rec-ratio", __name__, "_record", ratio=True)
    got = rec.call("m", "t", ["c"], "q?", max_new_tokens=3, store="s")
    assert got == ("m", "t", ["c"], "q?", dict(max_new_tokens=3, store="s", positions="composite"))
    assert rec_ratio.call("m", "t", [], "q", max_new_tokens=1)[4]["ratio"] == registry.DEFAULT_RATIO
    assert rec_ratio.call("m", "t", [], "q", max_new_tokens=1, ratio=0.3)[4]["ratio"] == 0.3
    with pytest.raises(ValueError, match="takes no recompute ratio"):
        rec.call("m", "t", [], "q", max_new_tokens=1, ratio=0.3)
    with pytest.raises(ValueError, match="no answer function"):
        registry.get("refrag").call("m", "t", [], "q", max_new_tokens=1)
    assert [m.name for m in registry.REGISTRY if m.cached and not m.ablation] == [
        "turborag-composite", "turborag-reordered", "block-attention", "full-reuse", "cacheblend", "fusionrag"]
