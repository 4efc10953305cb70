"""The sections of benchmarks.gpu_suite. Each takes a Ctx, fills ctx.results (raw figures) and
ctx.tables (what report.md shows), lists what it leaves out with ctx.skip(item, why), raises
Skipped when it cannot run at all, and watches its own budget (ctx.left()).

- exactness: the original fixture (stateful, batches of 3) in float32; the batch invariance of
  zero-state vectors per kernel; bf16 against float32 per output layer, on the device and on CPU.
- speed: bench_bilm.run_config over shapes, kernels, precisions and batch sizes.
- profile: torch.profiler's top operations of the Original shape, exact kernel, bf16.
- out_of_memory: a batch too large for the card, through embed_batch's halving.
- training: bench_training.bench on the device.
- end_to_end: bench_extract (extract against the model alone; the CPU worker sweep).
`--quick` runs each on tiny shapes; CUDA-only items are then listed as left out.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import h5py
import numpy as np
import torch

from elmo_pipeline.corpus.records import Sentence as SentenceRecord
from elmo_pipeline.embedding.batch import embed_batch
from elmo_pipeline.model.bilm import BiLM, CarriedState
from elmo_pipeline.model.config import CharCnnConfig, ElmoConfig, LstmConfig
from elmo_pipeline.model.lstm import EXACT, FUSED
from elmo_pipeline.runtime import autocast

from . import bench_bilm, bench_training
from .common import (batches_by_tokens, default_matmul_shape, flops_per_token, precision_probe, shape_config,
                     shared_data_dir, synchronize, wikitext_sentences)
from .kernel_drift import batch_drift
from .precision_drift import precision_drift
from .kernel_variants import (GRAPHED, GRAPHED_COMPILED, STATIC, graph_counts, is_available, static_layer,
                              swap_exact_layer, use_kernel)

FIXTURE_TOLERANCE = 1e-5


class Skipped(Exception):
    """The whole section cannot run here; the message says why."""


class SectionTimeout(Exception):
    """Raised by the suite's alarm when a section passes its hard limit."""


class CudaBroken(Exception):
    """The CUDA context no longer works (after an illegal access or a device assert): nothing
    more can run on the device in this process."""


@dataclass
class Ctx:
    device: torch.device
    quick: bool
    budget_s: float
    work: Path
    results: dict[str, Any] = field(default_factory=dict)
    tables: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def skip(self, item: str, reason: str) -> None:
        entry = {"item": item, "reason": reason}
        if entry not in self.skipped:
            self.skipped.append(entry)
            print(f"  left out: {item}: {reason}", flush=True)

    def afford(self, item: str, seconds: float) -> bool:
        """Whether `seconds` more fit in the budget; if not, `item` is listed as left out."""
        if self.left() >= seconds:
            return True
        self.skip(item, f"the section's budget ({self.budget_s:.0f} s) had {max(0.0, self.left()):.0f} s left")
        return False

    @contextlib.contextmanager
    def item(self, name: str) -> Iterator[None]:
        """One item of a section: an error in it leaves the item out, with the error, and the
        section goes on (a CUDA error that breaks the context will fail the next items too)."""
        try:
            yield
        except SectionTimeout:
            raise
        except Exception as exc:
            self.skip(name, f"failed: {type(exc).__name__}: {str(exc)[:300]}")
            free_device(self)

    def table(self, title: str, columns: Sequence[str], rows: list[list[Any]], note: str | None = None) -> None:
        self.tables.append({"title": title, "columns": list(columns), "rows": rows, "note": note})

    def variants(self, names: Sequence[str]) -> list[str]:
        """The kernel variants of `names` that run here; the others are listed as left out."""
        chosen = []
        for name in names:
            why = is_available(name, self.device)
            if why:
                self.skip(f"kernel {name}", why)
            else:
                chosen.append(name)
        return chosen


def free_device(ctx: Ctx) -> None:
    """Empties the CUDA cache; a context that an earlier error broke (an illegal access, a device
    assert) raises from every call, so this one raises CudaBroken for the suite to stop on."""
    if ctx.cuda:
        try:
            torch.cuda.synchronize(ctx.device)
            torch.cuda.empty_cache()
        except Exception as exc:
            raise CudaBroken(f"{type(exc).__name__}: {str(exc)[:300]}") from exc


# -- (a) exactness ----------------------------------------------------------------------------
def exactness(ctx: Ctx) -> None:
    fixture_check(ctx)
    if ctx.afford("batch invariance", 10):
        batch_invariance(ctx)
    if ctx.afford("bf16 drift", 10):
        bf16_drift(ctx)


def _fixture_model(device: torch.device) -> BiLM:
    d = shared_data_dir() / "allennlp_elmo"
    return BiLM.from_allennlp(str(d / "options.json"), str(d / "lm_weights.hdf5")).to(device).eval()


def fixture_check(ctx: Ctx) -> None:
    """The original implementation's top layer for sentences[0] (lm_embeddings_0.hdf5), written
    statefully in batches [sentences[0][i], sentences[1][i], sentences[2][i]], i = 0..9."""
    d = shared_data_dir() / "allennlp_elmo"
    sentences = json.loads((d / "sentences.json").read_text(encoding="utf-8"))
    with h5py.File(d / "lm_embeddings_0.hdf5", "r") as f:
        expected = [np.concatenate([f[str(i)][0], f[str(i)][1]], axis=-1) for i in range(10)]
    model = _fixture_model(ctx.device)
    rows: list[dict[str, Any]] = []
    ctx.results["fixture"] = rows  # filled as it goes: a section stopped early keeps what it measured
    for variant in ctx.variants((EXACT, STATIC, GRAPHED, FUSED)):
        worst = 0.0
        with ctx.item(f"fixture, {variant}"), use_kernel(model, variant) as fn, torch.no_grad():
            carried = CarriedState(model)
            for i in range(10):
                out = carried.embed([sentences[j][i].split() for j in range(3)])
                got = out.layers[-1, 0, : out.lengths[0]].float().cpu().numpy()
                worst = max(worst, float(np.abs(got - expected[i]).max()))
            rows.append({"kernel": variant, "max_abs_diff": worst, "within": worst <= FIXTURE_TOLERANCE,
                         **graph_counts(fn)})
    ctx.table(f"Original fixture (lm_embeddings_0, stateful, batches of 3), float32 on {ctx.device.type}",
              ["kernel", "max abs diff", f"within {FIXTURE_TOLERANCE:g}"],
              [[r["kernel"], r["max_abs_diff"], r["within"]] for r in rows],
              "The fixture model has clips (3, 3); fused has none, so it is not expected to match.")


def batch_invariance(ctx: Ctx) -> None:
    """Zero-state vectors of the same sentences embedded in small and large batches: the largest
    difference of any value, per kernel and output layer (the default model: no clips)."""
    model = BiLM.from_pretrained().to(ctx.device).eval()
    sentences = wikitext_sentences("valid")[: 24 if ctx.quick else 2000]
    budgets = (97, 512) if ctx.quick else (512, 16384)
    rows: list[dict[str, Any]] = []
    ctx.results["batch_invariance"] = {"sentences": len(sentences), "tokens": sum(map(len, sentences)),
                                       "batch_tokens": budgets, "rows": rows}  # filled as it goes
    for variant in ctx.variants((EXACT, FUSED, STATIC, GRAPHED)):
        if not ctx.afford(f"batch invariance, {variant}", 3):
            continue
        with ctx.item(f"batch invariance, {variant}"), use_kernel(model, variant):
            rows.append({"kernel": variant, "max_abs_diff_per_layer": batch_drift(model, sentences, budgets)})
    ctx.table(f"Batch invariance on {ctx.device.type}: max |batches of {budgets[0]} - of {budgets[1]} tokens|, "
              f"{len(sentences)} WikiText-2 valid sentences, default model, float32",
              ["kernel", *(f"layer {j}" for j in range(len(rows[0]["max_abs_diff_per_layer"]) if rows else 0))],
              [[r["kernel"], *r["max_abs_diff_per_layer"]] for r in rows])


def bf16_drift(ctx: Ctx) -> None:
    sentences = wikitext_sentences("valid")
    # (device, sentences, batch tokens, seconds it must be able to take): the host's CPU pass is
    # bounded so that it cannot take the GPU's rows, measured before it, past the hard limit
    places = [(ctx.device, sentences[: 16 if ctx.quick else len(sentences)], 8192, 5)]
    if ctx.cuda:
        places.append((torch.device("cpu"), sentences[: 300], 4096, 20))
    rows: list[dict[str, Any]] = []
    ctx.results["bf16_drift"] = rows  # filled as it goes: a section stopped early keeps what it measured
    for device, chosen, budget, needs in places:
        if not ctx.afford(f"bf16 drift on {device.type}", needs):
            continue
        model = BiLM.from_pretrained().to(device).eval()
        measured = [{"device": device.type, "sentences": len(chosen), "layer": j, **r}
                    for j, r in enumerate(precision_drift(model, chosen, budget))]
        rows.extend(measured)
    ctx.table("bf16 autocast against float32, per output layer (default model, exact kernel, WikiText-2 valid)",
              ["device", "sentences", "layer", "max", "mean", "99.9th percentile", "relative RMS", "min cosine"],
              [[r["device"], r["sentences"], r["layer"], r["max"], r["mean"], r["p999"], r["rel_rms"], r["min_cos"]]
               for r in rows])


# -- (b) speed --------------------------------------------------------------------------------
# (shape, precision, kernel variants, batch tokens), in the order they run: what the targets
# need first, so that a budget spent early loses the least
SPEED_FULL = [
    ("original", "bf16", (EXACT, FUSED, GRAPHED), (32768,)),
    ("original", "bf16", (EXACT, FUSED, GRAPHED), (8192, 131072, 262144)),
    ("small", "bf16", (EXACT, FUSED, GRAPHED), (8192, 32768, 131072, 262144)),
    ("original", "fp32", (EXACT, FUSED, GRAPHED), (8192, 32768)),
    ("small", "fp32", (EXACT, FUSED, GRAPHED), (8192, 32768)),
    ("original", "bf16", (GRAPHED_COMPILED,), (32768,)),
]
SPEED_QUICK = [
    ("tiny", "bf16", (EXACT, FUSED, STATIC, GRAPHED), (128,)),  # bf16 is emulated on most CPUs: slow
    ("tiny", "fp32", (EXACT, STATIC), (512, 2048)),
]


@contextlib.contextmanager
def one_model_per_shape() -> Iterator[None]:
    """bench_bilm.run_config builds a model per call; within the block it gets the last one of
    the same shape back (random weights, same seed: the same model), and one at a time is kept."""
    original = bench_bilm.build_model
    kept: dict[tuple, BiLM] = {}

    def build(shape: str, cache: bool, device: torch.device, seed: int = 0) -> BiLM:
        key = (shape, cache, str(device), seed)
        if key not in kept:
            kept.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            kept[key] = original(shape, cache, device, seed)
        return kept[key]

    bench_bilm.build_model = build
    try:
        yield
    finally:
        bench_bilm.build_model = original


def speed_row(result: bench_bilm.Result, variant: str, precision: str, budget: int, batches: int,
              extra: dict[str, Any]) -> dict[str, Any]:
    return {"shape": result.shape, "kernel": variant, "precision": precision, "batch_tokens": budget,
            "batches": batches, "tokens": result.tokens, "seconds": result.seconds,
            "tokens_per_s": result.tokens_per_s, "model_gflops": result.model_gflops,
            "work_gflops": result.work_gflops, "matmul_gflops": result.matmul_gflops,
            "model_over_mm": result.model_gflops / result.matmul_gflops,
            "work_over_mm": result.work_gflops / result.matmul_gflops, **extra}


def speed_config(ctx: Ctx, shape: str, precision: str, variant: str, budget: int, batches: list,
                 seconds: float) -> dict[str, Any]:
    fn = static_layer(variant, max_graphs=256) if variant in (STATIC, GRAPHED, GRAPHED_COMPILED) else None
    if ctx.cuda and fn is not None and hasattr(fn, "max_bytes"):
        fn.max_bytes = torch.cuda.get_device_properties(ctx.device).total_memory // 4
    # a graphed kernel captures each bucket once: warm up on every batch so that no capture is timed
    warmup = min(len(batches), 64) if variant in (GRAPHED, GRAPHED_COMPILED) else 2
    mm_shape = (128, 128, 128) if ctx.quick else default_matmul_shape(ctx.device)
    settings = bench_bilm.Settings(ctx.device, precision, seconds, warmup, mm_shape)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with swap_exact_layer(fn) if fn is not None else contextlib.nullcontext():
        result = bench_bilm.run_config(shape, FUSED if variant == FUSED else EXACT, False, batches, settings)
    extra = graph_counts(fn)
    if ctx.cuda:
        extra["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    return speed_row(result, variant, precision, budget, len(batches), extra)


def speed(ctx: Ctx) -> None:
    matrix = SPEED_QUICK if ctx.quick else SPEED_FULL
    seconds = 0.15 if ctx.quick else 2.5
    sentences = wikitext_sentences("valid")
    if ctx.quick:
        sentences = sentences[:120]
    rows: list[dict[str, Any]] = []
    ctx.results["rows"] = rows  # filled as it goes: a section stopped early keeps what it measured
    batches_for: dict[int, list] = {}
    with one_model_per_shape():
        for shape, precision, variants, budgets in matrix:
            for budget in budgets:
                for variant in ctx.variants(variants):
                    item = f"{shape} {variant} {precision} {budget} tokens"
                    # a compiled step pays torch.compile's cold start (twice: two bucket shapes)
                    margin = 2 if ctx.quick else (60 if variant == GRAPHED_COMPILED else 6)
                    if not ctx.afford(item, seconds + margin):
                        continue
                    batches = batches_for.setdefault(budget, batches_by_tokens(sentences, budget))
                    with ctx.item(item):
                        row = speed_config(ctx, shape, precision, variant, budget, batches, seconds)
                        rows.append(row)
                        print(f"  {item}: {row['tokens_per_s']:,.0f} tokens/s, work {row['work_over_mm']:.1%} of "
                              "matmul", flush=True)
    flops = {s: flops_per_token(shape_config(s)).total for s in dict.fromkeys(m[0] for m in matrix)}
    ctx.results["mflop_per_token"] = {s: f / 1e6 for s, f in flops.items()}
    ctx.table(f"biLM forward pass on {ctx.device.type} (bench_bilm.run_config: WikiText-2 valid, random weights, "
              "no word cache); matmul = same-run GEMM in the row's precision",
              ["shape", "kernel", "precision", "batch tokens", "tokens/s", "model TFLOP/s", "work TFLOP/s",
               "matmul TFLOP/s", "work/mm", "peak GiB"],
              [[r["shape"], r["kernel"], r["precision"], r["batch_tokens"], r["tokens_per_s"], r["model_gflops"] / 1e3,
                r["work_gflops"] / 1e3, r["matmul_gflops"] / 1e3, r["work_over_mm"], r.get("peak_gib")] for r in rows],
              "graphed: the static-shape exact layer (model/lstm_static.py) replayed as CUDA graphs; "
              "static: the same loop eagerly. MFLOP/token: "
              + ", ".join(f"{s} {v / 1e6:.1f}" for s, v in flops.items()))


# -- profile ----------------------------------------------------------------------------------
_CATEGORIES = (
    ("matrix products", ("gemm", "cutlass", "xmma", "sm90", "matmul", "aten::mm", "aten::bmm", "aten::baddbmm",
                         "aten::addmm", "cublas", "wgmma")),
    ("copies and fills", ("copy", "memcpy", "memset", "fill", "cat", "index", "gather", "stack")),
    ("convolution and pooling", ("conv", "pool", "max")),
    ("elementwise", ("elementwise", "vectorized", "sigmoid", "tanh", "clamp", "where", "mul", "add", "relu",
                     "triton", "reduce")),
)


def category(name: str) -> str:
    lowered = name.lower()
    for label, keys in _CATEGORIES:
        if any(k in lowered for k in keys):
            return label
    return "other"


def profile_rows(prof: Any, cuda: bool) -> tuple[list[dict[str, Any]], dict[str, float], float]:
    """The top operations by self time on the device (CUDA kernels) or on the CPU (aten ops)."""
    rows = []
    for evt in prof.key_averages():
        if cuda:
            if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        else:
            us = evt.self_cpu_time_total
        if us > 0:
            rows.append({"name": evt.key[:120], "calls": evt.count, "ms": us / 1e3})
    total = sum(r["ms"] for r in rows)
    shares: dict[str, float] = {}
    for r in rows:
        r["share"] = r["ms"] / total if total else 0.0
        shares[category(r["name"])] = shares.get(category(r["name"]), 0.0) + r["share"]
    rows.sort(key=lambda r: -r["ms"])
    return rows[:15], shares, total


def profile(ctx: Ctx) -> None:
    """Where the time of the Original shape, exact kernel, bf16 goes (and of the graphed variant)."""
    shape, budget, count = ("tiny", 128, 2) if ctx.quick else ("original", 32768, 3)
    batches = batches_by_tokens(wikitext_sentences("valid"), budget)[:count]
    model = bench_bilm.build_model(shape, False, ctx.device)
    for variant in ctx.variants((EXACT, GRAPHED) if ctx.cuda else (EXACT, STATIC)):
        if ctx.afford(f"profile {variant}", 5):
            with ctx.item(f"profile {variant}"):
                profile_variant(ctx, model, variant, batches, f"{shape}, {variant}, bf16, {count} batches of {budget} tokens")


def profile_variant(ctx: Ctx, model: BiLM, variant: str, batches: list, label: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with use_kernel(model, variant), torch.inference_mode(), autocast(ctx.device, "bf16"):
        for batch in batches:  # warm-up, the graphed variant's captures included
            model.embed(batch)
        synchronize(ctx.device)
        start = time.perf_counter()
        with torch_profile(activities=activities) as prof:
            for batch in batches:
                model.embed(batch)
            synchronize(ctx.device)
        wall_ms = (time.perf_counter() - start) * 1e3
    top, shares, busy_ms = profile_rows(prof, ctx.cuda)
    where = "device" if ctx.cuda else "CPU"
    ctx.results[variant] = {"wall_ms": wall_ms, f"{where}_busy_ms": busy_ms, "shares": shares, "top": top,
                            "tokens": sum(len(s) for b in batches for s in b)}
    ctx.table(f"Profile: {label}: {wall_ms:,.0f} ms wall (profiled), {busy_ms:,.0f} ms of {where} time",
              ["operation", "calls", f"self {where} ms", "share"],
              [[r["name"], r["calls"], r["ms"], f"{r['share']:.1%}"] for r in top],
              "By kind: " + ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])))


# -- (c) out of memory ------------------------------------------------------------------------
def _oom_config() -> ElmoConfig:
    """A wide cell and a narrow projection: the exact kernel's input-gate buffer (2 x positions
    x 4H values) fills the card while the FLOPs per position stay small."""
    return ElmoConfig(
        lstm=LstmConfig(dim=8192, projection_dim=32, n_layers=2, cell_clip=3.0, proj_clip=3.0,
                        use_skip_connections=True),
        char_cnn=CharCnnConfig(embedding_dim=4, filters=((1, 8), (2, 8)), n_highway=1), name="oom-probe")


def _records(sentences: list[list[str]]) -> list[SentenceRecord]:
    return [SentenceRecord(f"doc{i}", i, 0, tuple(s), np.zeros(len(s), np.int64), np.zeros(len(s), np.int64))
            for i, s in enumerate(sentences)]


def out_of_memory(ctx: Ctx) -> None:
    """A batch several times larger than the card's free memory goes through embed_batch, which
    halves it on out-of-memory: every sentence must come out, in order, with all its tokens.
    Off CUDA the error is simulated (the model raises it for batches over 8 sentences)."""
    pool = [s for s in wikitext_sentences("valid") if 20 <= len(s) <= 30]
    if ctx.cuda:
        torch.manual_seed(0)
        model = BiLM(_oom_config(), cache_size=0).to(ctx.device).eval()
        free, total = torch.cuda.mem_get_info(ctx.device)
        per_position = 2 * 4 * model.config.lstm.dim * 4  # float32 input gates, both directions
        rows = int(1.5 * free / per_position / 32) + 1  # positions / (30 tokens + boundaries)
        simulated = False
    else:
        torch.manual_seed(0)
        model = bench_bilm.build_model("tiny", False, ctx.device)
        free = total = rows = 0
        rows, simulated = 40, True
    sentences = [pool[i % len(pool)] for i in range(rows)]
    records = _records(sentences)
    splits: list[int] = []
    embed = model.embed
    if simulated:
        def embed_or_fail(batch, state=None):
            if len(batch) > 8:
                raise torch.OutOfMemoryError("simulated: CUDA out of memory")
            return embed(batch, state)
        model.embed = embed_or_fail
    if ctx.cuda:  # this section's peak, not the speed rows' before it
        torch.cuda.reset_peak_memory_stats(ctx.device)
    start = time.perf_counter()
    try:
        out = embed_batch(model, records, "fp32", on_split=splits.append)
    finally:
        model.__dict__.pop("embed", None)
    seconds = time.perf_counter() - start
    tokens_in, tokens_out = sum(len(s) for s in sentences), sum(o.layers.shape[1] for o in out)
    in_order = [o.sentence.key for o in out] == [r.key for r in records]
    result = {"simulated": simulated, "free_gib": free / 2**30, "total_gib": total / 2**30, "sentences_in": len(records),
              "sentences_out": len(out), "tokens_in": tokens_in, "tokens_out": tokens_out, "in_order": in_order,
              "splits": len(splits), "largest_split": max(splits, default=0), "seconds": seconds,
              "all_there": len(out) == len(records) and tokens_in == tokens_out and in_order}
    if ctx.cuda:
        result["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    ctx.results.update(result)
    ctx.table("Out of memory" + (" (simulated: no CUDA)" if simulated else f" on a card with {free / 2**30:.1f} GiB free"),
              ["sentences in", "sentences out", "tokens in", "tokens out", "in order", "halvings", "seconds"],
              [[len(records), len(out), tokens_in, tokens_out, in_order, len(splits), seconds]])
    if not result["all_there"]:
        raise AssertionError(f"sentences or tokens lost after halving: {result}")
    if not splits:
        raise AssertionError("the batch fit: nothing was halved (the probe's size is wrong for this card)")


# -- (d) training -----------------------------------------------------------------------------
def training(ctx: Ctx) -> None:
    preset, lines, seconds, batch_tokens = ("tiny", 40, 0.3, 256) if ctx.quick else ("small", 1500, 20.0, 16384)
    precision = "bf16" if ctx.cuda else "fp32"  # pretrain's auto
    if not ctx.cuda and not ctx.quick:
        ctx.skip("bf16 training", "the suite trains in bf16 on CUDA only; on CPU this runs float32")
    probe = precision_probe(ctx.device, precision, (64, 64, 64) if ctx.quick else None)
    corpus = bench_training.prepare_wikitext(str(ctx.work / "corpus"), lines)
    # what the corpus left of the budget, less the model's build and warm-up: past the hard limit
    # the whole measurement would be lost
    seconds = min(seconds, max(0.3 if ctx.quick else 5.0, 0.6 * ctx.left()))
    result = bench_training.bench(preset, corpus, ctx.device, seconds, batch_tokens, probe, precision)
    ctx.results.update(result)
    ctx.table(f"Training (bench_training, preset {preset}, {result['precision']}, "
              f"{result['batch_tokens']} batch tokens)",
              ["device", "tokens/s", "train FLOP/token", "work TFLOP/s", "matmul TFLOP/s", "ratio"],
              [[result["device"], result["tokens_per_s"], result["train_flops_per_token"], result["work_gflops"] / 1e3,
                result["matmul_gflops"] / 1e3, result["ratio"]]])


# -- (e) end to end ---------------------------------------------------------------------------
def beam_and_spacy_problem() -> str | None:
    for module in ("apache_beam", "spacy", "elmo_pipeline.pipelines.extract"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a broken install of either
            return f"cannot import {module} here ({type(exc).__name__}: {str(exc)[:200]}): the end-to-end runs need it"
    return None


def end_to_end(ctx: Ctx) -> None:
    problem = beam_and_spacy_problem()
    if problem:
        raise Skipped(problem)
    from . import bench_extract  # imports Beam

    d = shared_data_dir() / "allennlp_elmo"
    common = ["--skip-sizes", "--device", ctx.device.type]
    if ctx.quick:
        argv = ["--model", f"{d / 'options.json'},{d / 'lm_weights.hdf5'}", "--max-lines", "30", "--batch-tokens", "1024"]
    else:
        argv = ["--random-shape", "original", "--max-lines", "3000", "--batch-tokens", "32768"]
    precision = "bf16" if ctx.cuda else "fp32"  # bench_extract times the model alone at the job's precision
    argv += ["--precision", precision]
    path = ctx.work / "extract.json"
    bench_extract.main([*argv, *common, "--json", str(path)])
    figures = json.loads(path.read_text())
    ctx.results["extract"] = figures
    ctx.table(f"extract --device {ctx.device.type} against the model alone ({figures['model']}, "
              f"{figures['max_lines']} lines of WikiText-2 valid, {precision})",
              ["tokens", "pipeline s", "pipeline tokens/s", "model-only tokens/s", "pipeline / model-only"],
              [[figures["summary"]["tokens"], figures["summary"]["seconds"], figures["pipeline_tokens_per_s"],
                figures["model_only_tokens_per_s"], figures["ratio"]]])
    workers = min(16, os.cpu_count() or 1)
    if ctx.quick:
        ctx.skip("CPU worker sweep", "quick mode runs one Beam job (the sweep starts worker processes)")
    elif workers < 2:
        ctx.skip("CPU worker sweep", "one CPU")
    elif ctx.afford("CPU worker sweep", 45):
        path = ctx.work / "sweep.json"
        bench_extract.main(["--sweep-workers", str(workers), "--repeats", "1", "--max-lines", "1000",
                            "--device", "cpu", "--json", str(path)])
        sweep = json.loads(path.read_text())
        ctx.results["sweep"] = sweep
        ctx.table(f"CPU extraction, {workers} worker processes against one ({sweep['model']}, "
                  f"{sweep['max_lines']} lines)", ["runner", "torch threads", "tokens", "tokens/s"],
                  [[r["runner"], r["threads"], r["tokens"], r["tokens_per_s"]] for r in sweep["sweep"]])
