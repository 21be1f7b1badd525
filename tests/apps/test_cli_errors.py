"""Every `python -m ragattn` sub-command fails the same way: a bad input gives one
`error: ...` line on stderr and exit status 2, found before the work starts where it can be; an
output that cannot be written never loses what was computed; refrag-train never replaces a
checkpoint without --overwrite."""
import errno
from pathlib import Path

import pytest
import torch

from ragattn.__main__ import main as cli_main


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


def _a_file(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    return str(f)


def _dictd(tmp_path):
    """A small gzipped dictd file (the fine-tuning's training text format) of 400 entries."""
    import gzip

    path = tmp_path / "text.dict.dz"
    words = " ".join(f"word{i}" for i in range(30))
    with gzip.open(path, "wt") as fh:
        fh.write("".join(f"Entry{i:03d}\n\n   {words}.\n\n" for i in range(400)))
    return str(path)


def _config_folder(tmp_path, **config):
    """A checkpoint folder holding only a config.json (enough to be refused before any weight loads)."""
    import json

    d = tmp_path / f"model-{config['model_type']}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def _cases(tmp_path):
    f = _a_file(tmp_path)
    out = str(tmp_path / "out")
    ckpt = tmp_path / "corrupt.pt"
    ckpt.write_bytes(b"PK\x03\x04 not a checkpoint")
    cases = [
        (["check-model", str(tmp_path / "no-such-model")], "no such folder"),
        (["check-model", str(tmp_path)], "has no config.json"),
        (["check-model", _config_folder(tmp_path, model_type="gpt2")], "model family 'gpt2'"),
        (["check-model", _config_folder(tmp_path, model_type="no-such-family")], "cannot read the config"),
        (["check-model", "smollm2", "--methods", "rapid"], "unknown method 'rapid'"),
        (["check-model", "smollm2", "--probes", "0"], "--probes must be >= 1"),
        (["check-model", "smollm2", "--ratio", "150"], "--ratio is a percentage"),
        (["check-model", "smollm2", "--warn-kl", "2"], "--warn-kl (2.0) must not exceed --max-kl"),
        (["check-model", "smollm2", "--min-agreement", "nan"], "--min-agreement must be a finite number"),
        (["check-model", "smollm2", "--store", f], "--store"),
        (["demo", "--top-k", "0"], "--top-k must be >= 1"),
        (["demo", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 1"),
        (["demo", "--limit", "-1"], "--limit must be >= 0"),   # as eval (the demo ran every question)
        (["build-store", "--out", out, "--device", "xyz"], "unknown device 'xyz'"),
        (["build-store", "--out", f], "exists and is not a folder"),
        (["build-store", "--out", out, "--batch", "0"], "--batch must be >= 1"),
        (["eval", "--no-progress", "--out", out, "--device", "xyz"], "unknown device 'xyz'"),
        (["eval", "--no-progress", "--out", f], "--out"),
        (["eval", "--no-progress", "--out", out, "--store", f], "--store"),
        (["eval", "--no-progress", "--out", out, "--top-k", "0"], "--top-k needs integers >= 1"),
        (["eval", "--no-progress", "--out", out, "--top-k", "500"], "exceeds the corpus's"),
        (["finetune", "--out", out, "--device", "xyz"], "unknown device 'xyz'"),
        (["finetune", "--out", out, "--lr", "nan"], "--lr must be a finite number > 0"),
        (["finetune", "--out", out, "--lr=-1e-5"], "--lr must be a finite number > 0"),
        (["finetune", "--out", out, "--top-k", "0"], "--top-k must be LO,HI"),
        (["finetune", "--out", out, "--schemes", "sorted"], "--schemes"),
        (["finetune", "--out", out, "--text", f], "not a gzipped dictd file"),
        (["finetune", "--out", f], "--out"),
        (["finetune", "--out", out, "--steps", "0"], "--steps must be >= 1"),
        (["refrag-train", "--device", "xyz"], "unknown device 'xyz'"),
        (["refrag-train", "--threads", "-1"], "threads must be >= 1"),
        (["refrag-train", "--recon-lr", "nan"], "recon_lr must be a finite number > 0"),
        (["refrag-train", "--rl-lr", "0"], "rl_lr must be a finite number > 0"),
        (["refrag-train", "--checkpoint", str(tmp_path)], "is a folder"),
        (["refrag-train", "--checkpoint", str(tmp_path / "k.pt"), "--out", f], "--out"),
        (["refrag-train", "--checkpoint", str(ckpt), "--resume"], "is not a readable checkpoint"),
        (["refrag-train", "--rl-expand", "0"], "rl_expand"),
        # a bad --model is named by the command that was run (build-store and finetune said "ragattn demo")
        (["build-store", "--out", out, "--model", "gpt-17"], "ragattn build-store: unsupported model 'gpt-17'"),
        (["finetune", "--out", out, "--text", _dictd(tmp_path), "--top-k", "2,4", "--model", "gpt-17"],
         "ragattn finetune: unsupported model 'gpt-17'"),
        (["eval", "--no-progress", "--out", out, "--model", "gpt-17"], "unsupported model 'gpt-17'"),
    ]
    if not torch.cuda.is_available():
        cases += [([cmd, *pre, "--device", "cuda"], "no CUDA device is available")
                  for cmd, pre in (("build-store", ["--out", out]), ("eval", ["--no-progress", "--out", out]),
                                   ("finetune", ["--out", out]), ("refrag-train", []), ("check-model", ["smollm2"]))]
    return cases


def test_every_bad_input_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAGATTN_REFRAG_CKPT", str(tmp_path / "default.pt"))
    for argv, needle in _cases(tmp_path):
        assert cli_main(argv) == 2, argv
        _one_line_error(capsys, needle)
    assert not (tmp_path / "default.pt").exists()


def test_user_errors_from_inside_a_command_take_the_same_path(capsys):
    from ragattn.apps.cli import run_command
    from ragattn.store import ChunkStoreError

    def store_error():
        raise ChunkStoreError("ragattn.ChunkStore: cannot write x.safetensors to directory /d (No space left on device)")

    assert run_command(store_error, "python -m ragattn eval") == 2
    _one_line_error(capsys, "No space left on device")

    def bug():
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        run_command(bug, "python -m ragattn eval")


def test_a_failed_output_keeps_the_result(tmp_path):
    from ragattn.apps.cli import UsageError, save_or_keep

    calls = []

    def write(p):
        calls.append(p)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        Path(p).write_text("the result")

    with pytest.raises(UsageError, match="No space left on device.*kept in") as exc:
        save_or_keep(write, tmp_path / "results.json", "--out")
    kept = Path(str(exc.value).rsplit("kept in ", 1)[1])
    assert kept.read_text() == "the result" and kept.name == "results.json"


def test_refrag_checkpoints_are_never_overwritten_without_asking(tmp_path):
    from ragattn.methods.refrag.train import checkpoint_path_for_run, policy_checkpoint_path

    ckpt = tmp_path / "k8.pt"
    assert checkpoint_path_for_run(ckpt) == ckpt                   # nothing there yet
    ckpt.write_bytes(b"trained")
    assert checkpoint_path_for_run(ckpt) == tmp_path / "k8.run2.pt"
    assert checkpoint_path_for_run(ckpt, overwrite=True) == ckpt
    policy_checkpoint_path(tmp_path / "k8.run2.pt").write_bytes(b"a policy")
    assert checkpoint_path_for_run(ckpt) == tmp_path / "k8.run3.pt"


def test_a_zero_step_refrag_run_leaves_a_trained_checkpoint_alone(tmp_path, smollm2, minilm_dir, capsys):
    """A 0-step run must not replace the trained checkpoint at the default path."""
    from ragattn.apps import refrag_train as rt

    ckpt = tmp_path / "k8.pt"
    argv = ["--stages", "recon", "--recon-steps", "0", "--max-chunks", "1", "--eval-examples", "1",
            "--curriculum-stages", "1", "--checkpoint", str(ckpt), "--no-progress"]
    assert rt.main(argv) == 0
    first = ckpt.read_bytes()
    assert rt.main(argv) == 0
    assert ckpt.read_bytes() == first and (tmp_path / "k8.run2.pt").is_file()
    assert "pass --overwrite to replace it" in capsys.readouterr().err
    assert rt.main(argv + ["--max-chunks", "100000"]) == 2                # too large: one error line
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "no passage has" in lines[0] and "Traceback" not in err, err
