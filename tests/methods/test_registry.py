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
    assert "refrag" in registry.names(demo=True) and not registry.get("refrag").store


def test_behaviour_flags():
    """What the readers do with a method comes from these flags, not from its name."""
    assert [m.name for m in registry.REGISTRY if m.positions == "composite"] == ["turborag-composite"]
    assert {m.name: m.selection for m in registry.REGISTRY if m.ratio} == {
        "cacheblend": "deviation", "fusionrag": "query", "fusionrag-standalone": "query"}
    assert all(m.selection is None for m in registry.REGISTRY if not m.ratio)
    for m in registry.REGISTRY:
        if m.serves_as is not None:
            assert m.served and registry.get(m.serves_as).served and registry.find(m.serves_as).serves_as is None
            assert m.positions == registry.get(m.serves_as).positions


def test_answer_calls_with_options_and_ratio(monkeypatch):
    """``Method.answer``: the fixed options, the ratio (default for a ratio method, refused for
    the others) and the caller's extras reach the answer function."""
    import types

    seen = []
    fake = types.ModuleType("ragattn_fake_method")
    fake.answer = lambda *a, **kw: seen.append((a, kw)) or "ans"
    monkeypatch.setitem(__import__("sys").modules, "ragattn_fake_method", fake)
    m = registry.Method("x", "ragattn_fake_method", "answer", (("positions", "composite"),), ratio=True)
    assert m.answer("M", "T", ["c"], "q?", max_new_tokens=3) == "ans"
    assert seen[-1] == (("M", "T", ["c"], "q?"), dict(max_new_tokens=3, store=None, positions="composite",
                                                      ratio=registry.DEFAULT_RATIO))
    m.answer("M", "T", ["c"], "q?", max_new_tokens=3, store="S", ratio=0.5, eta=2.0)
    assert seen[-1][1] == dict(max_new_tokens=3, store="S", positions="composite", ratio=0.5, eta=2.0)
    plain = registry.Method("y", "ragattn_fake_method", "answer")
    with pytest.raises(ValueError, match="takes no recompute ratio"):
        plain.answer("M", "T", ["c"], "q?", max_new_tokens=3, ratio=0.2)
    with pytest.raises(ValueError, match="no answer function"):
        registry.Method("z", "ragattn_fake_method", "missing").answer("M", "T", ["c"], "q?", max_new_tokens=3)


def test_check_ratio():
    assert registry.check_ratio(0) is None and registry.check_ratio(1.0) is None
    for bad in (-0.1, 1.5, float("nan"), True, "0.1", None):
        assert "must be a number in [0, 1]" in registry.check_ratio(bad)


def test_readers_take_the_registry():
    from ragattn.apps import demo, eval as ev
    from ragattn.vllm import spans

    assert demo.METHOD_NAMES == list(registry.names(demo=True))
    assert [m.name for m in ev.REGISTRY] == list(registry.names())
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
    assert served_methods.MEASURED == (registry.BASELINE, "block-attention", "turborag-composite", "cacheblend",
                                       "fusionrag")
    assert [m.name for m in registry.REGISTRY if m.store and not m.ablation] == [
        "turborag-composite", "turborag-reordered", "block-attention", "full-reuse", "cacheblend", "fusionrag"]
