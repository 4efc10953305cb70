"""`pretrain`: training and fine-tuning the biLM on a prepared corpus.

- Objective: 0.5 * (forward NLL + backward NLL), token encoder and softmax shared by both
  directions (see `lm.py`); every sentence starts from a zero state, as in extraction.
- Optimizer: Adagrad (learning rate 0.2, initial accumulator 1.0, as the original) or Adam;
  a linear warmup, then a constant, linear or cosine learning rate (torch's LambdaLR);
  global gradient-norm clip; gradient accumulation; bf16 autocast (`precision`) on GPU or CPU,
  the parameters, their gradients, the optimizer state and the LSTM cell state in float32.
- Several processes through torchrun (DistributedDataParallel, NCCL or gloo).
- Checkpoints every N steps (and/or every S seconds) and at the end, atomically, the last K
  kept. Running the same command again resumes from the newest checkpoint exactly: model,
  optimizer, every process's random state and the data position.
- `init`: continue from a native model (its vocabulary grows with the corpus's new words)
  or from original weights (`options.json,weights.hdf5`: no softmax, a new one is built).

This module is the loop; the options are in `options.py`, the model a new run starts from in
`initial_model.py`, the optimizer and its schedule in `optimizer.py`, metrics.csv in
`metrics_log.py`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable, Collection, ContextManager, Iterator, TextIO

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from elmo_pipeline.filesystems import without_userinfo
from elmo_pipeline.formats.atomic import check_output_folder, recover_folder, replace_folder, write_url_atomically
from elmo_pipeline.formats.files import CheckpointError
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.config import fields_differing
from elmo_pipeline.model.lstm import check_kernel
from elmo_pipeline.strict import dumps_strict
from elmo_pipeline.progress import note_tokens, progress_bar
from elmo_pipeline.runtime import autocast
from elmo_pipeline.training import checkpointing as ckpt
from elmo_pipeline.training.data import BatchStream, Position
from elmo_pipeline.training.distributed import DistContext, init_distributed
from elmo_pipeline.training.evaluate import (NonFinitePerplexity, check_sentences, data_sentences, evaluate_sentences,
                                             perplexity)
from elmo_pipeline.training.initial_model import build_model
from elmo_pipeline.training.lm import LmObjective, make_batch, run_objective
from elmo_pipeline.training.metrics_log import MetricsLog
from elmo_pipeline.training.optimizer import make_optimizer, make_scheduler
from elmo_pipeline.training.options import (TrainArgs, check_ranges, check_options_read, given_options,
                                            run_args_as_now, training_precision)
from elmo_pipeline.training.shards import PreparedCorpus, vocab_digest
from elmo_pipeline.training.stopping import STOP_SIGNALS, StoppedBySignal, StopRequest


class StopTraining(Exception):
    """Raised by a step hook to stop a run (tests use it to simulate a crash)."""


class TrainingDiverged(RuntimeError):
    """A non-finite gradient norm or validation perplexity: the run stops before the weights
    or anything published take the non-finite values."""


# options that build the model: a resumed run's comes from its checkpoint
_FIXED_AT_START = ("preset", "model_config", "init", "grow_vocab", "softmax", "n_samples", "cutoffs")
_CORPUS_KEY = "corpus"  # run.json: the prepared corpus the run started on (_corpus_identity)
_MODEL_KEY = "model"  # run.json: the configuration of the model the run started with


def valid_shown(valid: str | None) -> str | None:
    """--valid as the run's files record it (trainer_state.json, best/valid.json): a URL without
    its password (an earlier version's state, which held it, is read so), as in run.json."""
    return None if valid is None else without_userinfo(valid)


def _corpus_identity(corpus: PreparedCorpus) -> dict[str, Any]:
    """What tells one prepared corpus from another wherever it lies (a moved copy is the same)."""
    m = corpus.manifest
    return {"sentences": m.sentences, "tokens": m.tokens, "vocab_sha256": m.vocab_sha256}


def _fmt_time(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


# -- the loop's state -----------------------------------------------------------------------
@dataclass
class RunState:
    """What a checkpoint's trainer_state.json holds: where the run is."""
    step: int = 0
    position: Position = field(default_factory=Position)
    tokens: int = 0
    elapsed: float = 0.0
    best_valid: float | None = None
    best_step: int | None = None
    done: bool = False
    finished_under: list | None = None  # [epochs, max_steps] of the command that finished it
    # the sums of the steps since the last log line (Window, over every process), so that a
    # resumed run writes the log line an unbroken one would have
    window: dict | None = None
    # how the data was cut into the batches that `position` counts (`BatchStream.batching`)
    batching: dict | None = None
    best_data: str | None = None  # the --valid that best_valid was measured on, as recorded (`valid_shown`)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["position"] = self.position.to_dict()
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "RunState":
        return cls(int(raw["step"]), Position.from_dict(raw["position"]), int(raw["tokens"]),
                   float(raw["elapsed"]), raw.get("best_valid"), raw.get("best_step"), bool(raw.get("done", False)),
                   raw.get("finished_under"), raw.get("window"), raw.get("batching"), valid_shown(raw.get("best_data")))

    def result(self) -> dict[str, Any]:
        """`pretrain`'s answer."""
        return {"step": self.step, "done": self.done, "tokens": self.tokens, "best_valid": self.best_valid,
                "best_step": self.best_step, "elapsed_s": self.elapsed}


@dataclass
class Window:
    """Sums over this process's optimizer steps since the last log line."""
    fwd_nll: float = 0.0
    bwd_nll: float = 0.0
    predictions: int = 0
    words: int = 0
    grad_norm: float = 0.0
    steps: int = 0
    lr: float = 0.0  # the last step's
    started: float = field(default_factory=time.perf_counter)


def _window_totals(ctx: DistContext, window: Window) -> dict[str, Any]:
    """`window` summed over the processes, as a checkpoint keeps it (a collective call)."""
    fwd, bwd, n, words = ctx.sum([window.fwd_nll, window.bwd_nll, float(window.predictions), float(window.words)])
    return {"fwd_nll": fwd, "bwd_nll": bwd, "predictions": int(n), "words": int(words),
            "grad_norm": window.grad_norm, "steps": window.steps, "lr": window.lr,
            "seconds": time.perf_counter() - window.started}


def _carried_window(saved: dict | None, main: bool) -> Window:
    """The Window a resumed run goes on with: the sums in the main process only, since the log
    line sums them over the processes; the gradient norms (the same in every process) in each."""
    if not saved:
        return Window()
    share = 1 if main else 0
    return Window(fwd_nll=saved["fwd_nll"] * share, bwd_nll=saved["bwd_nll"] * share,
                  predictions=saved["predictions"] * share, words=saved["words"] * share,
                  grad_norm=saved["grad_norm"], steps=saved["steps"], lr=saved["lr"],
                  started=time.perf_counter() - saved["seconds"])


Micro = tuple[list[list[str]], list[Any], Position]  # a micro-batch as BatchStream yields it


@dataclass
class Session:
    """One invocation of `pretrain`: what `Trainer._setup` builds and the loop works with."""
    ctx: DistContext
    model: BiLM
    objective: nn.Module  # LmObjective, DDP-wrapped with several processes
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    stream: BatchStream
    metrics: MetricsLog
    state: RunState
    total_steps: int | None  # known for --max-steps and for a decaying schedule
    same_vocab: bool  # the prepared ids are the model's: no lookup per batch
    precision: str  # fp32 or bf16, as training_precision resolved it for this device
    autocast: ContextManager  # reentered for every micro-batch: products in `precision`, the rest float32
    params: list[nn.Parameter]
    started: float = field(default_factory=time.perf_counter)
    elapsed_before: float = 0.0  # the run's time in earlier invocations
    last_checkpoint: float = field(default_factory=time.perf_counter)
    pending_words: int = 0  # this process's words not yet added to state.tokens
    window: Window = field(default_factory=Window)
    stop_request: StopRequest = field(default_factory=StopRequest)
    stopped_for_time: bool = False
    stopped_by: int = 0  # the signal that stopped the run at a step boundary, the same in every process


def _write_best(model: BiLM, result: dict[str, Any], folder: str) -> None:
    model.save_pretrained(folder)
    with open(os.path.join(folder, "valid.json"), "w", encoding="utf-8") as f:
        f.write(dumps_strict(result, f"{folder}/valid.json", indent=2))


# -- the trainer ----------------------------------------------------------------------------
class Trainer:
    def __init__(self, args: TrainArgs, ctx: DistContext | None = None,
                 step_hook: Callable[[int], None] | None = None, out: TextIO | None = None,
                 given: Collection[str] | None = None) -> None:
        """`given`: the options the caller asked for (field names), as its command line tells them;
        by default those of `args` not at TrainArgs's defaults (`given_options`)."""
        self.args = args
        self.given = set(given_options(args) if given is None else given)
        self.ctx = ctx
        self.step_hook = step_hook
        self.out = out or sys.stderr
        self.model_dir = os.path.join(args.output, "model")
        self.best_dir = os.path.join(args.output, "best")

    def log(self, message: str) -> None:
        if self.ctx is None or self.ctx.is_main:
            tqdm.write(message, file=self.out)  # above the progress bar, which redraws below it
            self.out.flush()

    def run(self) -> dict[str, Any]:
        args = self.args
        check_ranges(args)  # again: a TrainArgs may have been changed since it was made
        check_options_read(args, self.given)
        if args.threads:
            torch.set_num_threads(args.threads)
        own_ctx = self.ctx is None
        ctx = self.ctx = self.ctx or init_distributed(args.device)
        try:
            return self._run(ctx)
        finally:
            if own_ctx:
                ctx.close()

    def _run(self, ctx: DistContext) -> dict[str, Any]:
        corpus = self._check_inputs()
        # A new run's model is built before anything is written: a bad config leaves no run behind.
        resuming = ckpt.latest_checkpoint(self.args.output) is not None
        if resuming:
            self._check_resumable(corpus)
        fresh = None if resuming else build_model(self.args, corpus, self.log, ctx.device)
        with self._claim_run(ctx, corpus, fresh):
            resume = ckpt.latest_checkpoint(self.args.output)
            model, state = self._model_and_state(corpus, resume, fresh)
            if state.done and state.finished_under == [self.args.epochs, self.args.max_steps]:
                return self._already_finished(ctx, model, state, resume)
            session = self._setup(ctx, corpus, model, state, resume)
            self._judge_best_on_this_valid(session)
            notice = "stopping after this step, with a checkpoint (the same signal again stops at once)"
            with session.stop_request.taken(notice if ctx.is_main else None):
                self._train(session)
                result = self._finish(session)
            if session.stopped_by:
                raise StoppedBySignal(session.stopped_by, f"{STOP_SIGNALS[session.stopped_by]} after step "
                                      f"{state.step}, which its checkpoint holds; the same command resumes there")
            return result

    # -- setup ----------------------------------------------------------------------------------
    def _check_inputs(self) -> PreparedCorpus:
        """The corpus, the output folder and the held-out data, checked before anything is
        written: a wrong --data or --valid found after training would cost the training."""
        args = self.args
        check_output_folder(args.output)
        corpus = PreparedCorpus(args.data)
        if corpus.manifest.tokens == 0:
            raise ValueError(f"--data {args.data}: the prepared corpus holds no tokens; there is nothing to train on")
        if args.valid:
            check_sentences(args.valid, args.valid_tokenizer, "--valid", read_all=True)
        return corpus

    @contextlib.contextmanager
    def _claim_run(self, ctx: DistContext, corpus: PreparedCorpus, fresh: BiLM | None) -> Iterator[None]:
        """The run folder, held by this run alone, as the last run left it (tidied), with run.json."""
        os.makedirs(self.args.output, exist_ok=True)
        with ckpt.run_lock(self.args.output) if ctx.is_main else contextlib.nullcontext():
            if ctx.is_main:
                ckpt.remove_temporaries(self.args.output)
                recover_folder(self.model_dir)
                recover_folder(self.best_dir)
                self._save_run_args(corpus, fresh)
            ctx.barrier()
            yield

    def _check_resumable(self, corpus: PreparedCorpus) -> None:
        """A run resumes on the corpus it started on (its data position means nothing in another),
        and with the model its first command built: an option that would shape another is refused."""
        path = os.path.join(self.args.output, "run.json")
        if not os.path.exists(path):
            return
        first = ckpt.read_json(path)
        if not isinstance(first, dict):
            raise ValueError(f"{path}: expected a JSON object (the run's first command)")
        first, current = run_args_as_now(first), self.args.to_dict()
        reshaped = [k for k in _FIXED_AT_START if k in self.given and first.get(k) != current[k]]
        if reshaped:
            then = "; ".join(f"--{k.replace('_', '-')} {first.get(k)!r} then, {current[k]!r} now" for k in reshaped)
            raise ValueError(f"{self.args.output} holds a run whose first command built its model ({then}): a resumed "
                             "run keeps that model; leave these options out or as they were, or give a new --output")
        self._check_optimizer_state(first)
        recorded = first.get(_CORPUS_KEY)
        if recorded is not None and recorded != _corpus_identity(corpus):
            raise ValueError(f"--data {self.args.data} is not the corpus {self.args.output} started on ({recorded} "
                             f"then, {_corpus_identity(corpus)} now): its data position would be applied to other "
                             "data; give that corpus, or a new --output (with --init to continue from its model)")

    def _check_optimizer_state(self, first: dict[str, Any]) -> None:
        """The checkpoints hold the state of the optimizer the run started with: Adagrad's sums and
        Adam's moments cannot be read by the other (a KeyError traceback at the first step), and
        the sums began at --adagrad-init, so another value given now would change nothing."""
        args, started = self.args, first.get("optimizer")
        if started is not None and started != args.optimizer:
            now = f"--optimizer {args.optimizer}" + ("" if "optimizer" in self.given else " (the default)")
            raise ValueError(f"{args.output} holds a run trained with --optimizer {started}, whose state its "
                             f"checkpoints hold; {now} cannot take it: give --optimizer {started} as its first command "
                             f"did, or a new --output with --init {ckpt.latest_checkpoint(args.output)}")
        if "adagrad_init" in self.given and first.get("adagrad_init") != args.adagrad_init:
            raise ValueError(f"--adagrad-init {args.adagrad_init}: {args.output} holds a run whose Adagrad sums began "
                             f"at {first.get('adagrad_init')}, and its checkpoints hold them, so the value would change "
                             "nothing; leave it out or as it was, or give a new --output")

    def _save_run_args(self, corpus: PreparedCorpus, fresh: BiLM | None) -> None:
        """run.json: the first command of the run the checkpoints continue. A run that left no
        checkpoint starts again from this command, whose model (an edited --model-config) is the one
        its checkpoints will hold, so its record is written anew."""
        path = os.path.join(self.args.output, "run.json")
        current = self.args.to_dict()
        if os.path.exists(path) and ckpt.latest_checkpoint(self.args.output) is not None:
            recorded = ckpt.read_json(path)
            if not isinstance(recorded, dict):
                raise ValueError(f"{path}: expected a JSON object (the run's first command)")
            first = run_args_as_now(recorded)
            # an option that builds the model, or began Adagrad's sums, is refused when given otherwise
            # (_check_resumable), so one that differs here was left out: the run keeps its first value
            kept = (*_FIXED_AT_START, "adagrad_init")
            changed = sorted(k for k in current if first.get(k) != current[k] and k not in kept)
            if changed:
                self.log(f"note: arguments differ from the run's first command: {', '.join(changed)}")
            if "precision" not in recorded and first.get("precision") == "bf16" and self.ctx.device.type != "cuda":
                self.log(f"note: the version that started this run trained in fp32 on {self.ctx.device.type} "
                         "(its --bf16 was for CUDA only); the steps from here run in bf16")
            return
        current[_CORPUS_KEY] = _corpus_identity(corpus)
        if fresh is not None:
            current[_MODEL_KEY] = fresh.config.to_dict()
        write_url_atomically(path, dumps_strict(current, path, indent=2, sort_keys=True).encode("utf-8"))

    def _model_and_state(self, corpus: PreparedCorpus, resume: str | None, fresh: BiLM | None,
                         ) -> tuple[BiLM, RunState]:
        if resume is None:
            return fresh or build_model(self.args, corpus, self.log, self.ctx.device), RunState()
        with ckpt.reading_checkpoint(resume):
            model = ckpt.load_checkpoint_model(resume)
            state = RunState.from_dict(ckpt.load_trainer_state(resume))
            self._check_started_model(model)
        # out here: the checkpoint is fine, and an error in it would say it cannot be read
        model.kernel = check_kernel(self.args.kernel, model.config.lstm)
        self.log(f"resuming from {resume} (step {state.step})")
        return model, state

    def _check_started_model(self, model: BiLM) -> None:
        """A checkpoint holds the model the run started with (run.json, from this version on): one
        of another run copied in was resumed, its other shape trained on as this run's."""
        path = os.path.join(self.args.output, "run.json")
        first = ckpt.read_json(path) if os.path.exists(path) else None
        started = first.get(_MODEL_KEY) if isinstance(first, dict) else None
        now = model.config.to_dict()
        if started is not None and now != started:
            differ = ", ".join(fields_differing(now, started))
            raise CheckpointError(f"its model's configuration is not the one {path} says the run started with "
                                  f"({differ} differ): a checkpoint of another run?")

    def _already_finished(self, ctx: DistContext, model: BiLM, state: RunState, resume: str | None,
                          ) -> dict[str, Any]:
        if ctx.is_main and not os.path.isdir(self.model_dir):  # a run finished by a version that wrote it last
            replace_folder(self.model_dir, model.save_pretrained)
            self.log(f"model/ was missing: written from {resume}")
        self.log("this run has already finished; nothing to do")
        return state.result()

    def _total_steps(self, stream: BatchStream, state: RunState) -> int | None:
        """The run's last step where a schedule needs it: --max-steps, or for a decay the end of
        --epochs when the data runs out first (a --max-steps past it left the last step near the
        full --lr): the steps done and those the data gives from the run's position, in the
        stream's cut (a run resumed on another counted a whole run of it, and ended its decay
        early). The batches are counted (every shard's ids read) only when the manifest cannot tell
        that the data lasts; a run that ends within its warm-up is warned of, not refused: a smoke
        test of a recipe, or a run cut to a deadline, ends there on purpose."""
        args = self.args

        def steps_with(per_shard: list[int]) -> int:
            return state.step + math.ceil(stream.batches_left(per_shard, state.position, args.epochs) / args.grad_accum)

        total = args.max_steps
        if args.schedule == "constant":
            return total
        if total is None or steps_with(stream.fewest_batches_per_shard()) < total:
            in_data = steps_with(stream.batches_per_shard())
            total = in_data if total is None else min(total, in_data)
        if 0 < total <= args.warmup_steps:
            ends = "--max-steps" if total == args.max_steps else f"--epochs {args.epochs} on {args.data}"
            self.log(f"warning: --schedule {args.schedule} decays the learning rate after --warmup-steps "
                     f"{args.warmup_steps}, and the run ends at step {total} ({ends}): it never decays, its last "
                     f"step at {total / args.warmup_steps:.3g} x --lr")
        return total

    def _setup(self, ctx: DistContext, corpus: PreparedCorpus, model: BiLM, state: RunState,
               resume: str | None) -> Session:
        args, device = self.args, ctx.device
        state.done = False
        model.to(device)
        model.train()
        objective = _objective(ctx, model)
        optimizer = make_optimizer(args, model)
        stream = BatchStream(corpus, seed=args.seed, batch_tokens=args.batch_tokens,
                             max_sentences=args.max_batch_sentences, rank=ctx.rank, world_size=ctx.world_size)
        # before the random states: a change in the number of processes is judged by the data
        # position (taken at a shard's start or end), not by a missing state file
        if resume and state.batching is not None:
            state.position = stream.resumed_position(state.position, state.batching)
        total_steps = self._total_steps(stream, state)
        # a process the checkpoint's run did not have (more processes now) has no state of its own
        new_process = resume is not None and state.batching is not None and ctx.rank >= state.batching["processes"]
        if resume:
            with ckpt.reading_checkpoint(resume):
                ckpt.restore_optimizer(resume, optimizer, device)
                if not new_process:
                    ckpt.restore_rng(resume, ctx.rank)
        if not resume or new_process:
            torch.manual_seed(args.seed * 1000003 + 17 + ctx.rank)  # dropout and sampling streams
        precision = training_precision(args.precision, device)
        metrics = MetricsLog(os.path.join(args.output, "metrics.csv"), ctx.is_main, state.step if resume else None)
        softmax = model.config.softmax
        full_anyway = softmax.kind == "sampled" and not model.softmax.samples
        self.log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, vocabulary "
                 f"{len(model.vocab or [])}, softmax {softmax.kind}"
                 + (f" ({softmax.n_samples:,} samples, no fewer than the words: trained on the full "
                    "softmax)" if full_anyway else "") + "; corpus "
                 f"{corpus.manifest.tokens:,} tokens in {corpus.n_shards} shard(s); {ctx.world_size} process(es) "
                 f"on {device}, {precision}")
        return Session(
            ctx=ctx, model=model, objective=objective, optimizer=optimizer,
            scheduler=make_scheduler(args, optimizer, total_steps, state.step), stream=stream, metrics=metrics,
            state=state, total_steps=total_steps, same_vocab=vocab_digest(model.vocab) == vocab_digest(corpus.vocab),
            precision=precision, autocast=autocast(device, precision),
            params=[p for p in model.parameters() if p.requires_grad], elapsed_before=state.elapsed,
            window=_carried_window(state.window if resume else None, ctx.is_main))

    # -- the loop -------------------------------------------------------------------------------
    def _train(self, s: Session) -> None:
        """Optimizer steps until --max-steps, the end of --epochs, --max-time or a stopping signal."""
        args = self.args
        batches = s.stream.iterate(s.state.position, args.epochs)
        with progress_bar("pretrain", total=s.total_steps, unit="steps", enabled=s.ctx.is_main,
                          initial=s.state.step) as bar:
            exhausted = False
            while not exhausted and (args.max_steps is None or s.state.step < args.max_steps):
                micro, exhausted = self._next_micro_batches(batches)
                if not micro:
                    break
                note_tokens(bar, 1, self._train_step(s, micro))
                self._after_step(s)
                if s.stopped_by or s.stopped_for_time:
                    break

    def _next_micro_batches(self, batches: Iterator[Micro]) -> tuple[list[Micro], bool]:
        """Up to --grad-accum micro-batches, and whether the data ended."""
        micro: list[Micro] = []
        for _ in range(self.args.grad_accum):
            try:
                micro.append(next(batches))
            except StopIteration:
                return micro, True
        return micro, False

    def _train_step(self, s: Session, micro: list[Micro]) -> int:
        """One optimizer step over the micro-batches (their mean loss); the words it trained on."""
        args, ctx, window = self.args, s.ctx, s.window
        s.optimizer.zero_grad(set_to_none=True)
        words = 0
        for k, (sentences, ids, _) in enumerate(micro):
            batch = make_batch(s.model, sentences, ids if s.same_vocab else None).to(ctx.device)
            sync = k == len(micro) - 1 or not ctx.enabled  # DDP reduces gradients after the last one only
            with contextlib.nullcontext() if sync else s.objective.no_sync(), s.autocast:
                f, b, n = run_objective(s.objective, batch, args.dropout)
                loss = (f + b) / (2 * n) / len(micro)
            loss.backward()
            window.fwd_nll += float(f.detach())
            window.bwd_nll += float(b.detach())
            window.predictions += n
            words += batch.n_words
        window.lr = s.scheduler.get_last_lr()[0]
        norm = _clip_gradients(s.params, args.clip_norm)
        if not math.isfinite(norm):  # the same in every process: the norm is of the reduced gradients
            raise TrainingDiverged(self._divergence(s, norm))
        window.grad_norm += norm
        s.optimizer.step()
        s.scheduler.step()
        s.state.step += 1
        s.state.position = micro[-1][2]
        window.words += words
        window.steps += 1
        s.pending_words += words
        return words

    def _divergence(self, s: Session, norm: float) -> str:
        return (f"training diverged at step {s.state.step + 1}: the gradient norm is {norm} at learning rate "
                f"{s.window.lr:.4g}; that step was not applied and the run stops, not done and without "
                f"model/. {self._what_to_do()}")

    def _what_to_do(self) -> str:
        last = ckpt.latest_checkpoint(self.args.output)
        then = (f"the last checkpoint, {last}, is where the same command resumes" if last else
                "no checkpoint was written, so the same command starts again")
        return f"Lower --lr or --clip-norm, or add --warmup-steps; {then}"

    def _check_finite_weights(self, s: Session) -> None:
        bad = next((name for name, p in s.model.named_parameters() if not bool(torch.isfinite(p).all())), None)
        if bad is not None:  # the same weights in every process (DDP keeps them equal)
            raise TrainingDiverged(f"training diverged by step {s.state.step}: parameter {bad!r} holds NaN or "
                                   f"infinite values; nothing of it is published. {self._what_to_do()}")

    def _after_step(self, s: Session) -> None:
        """Logging, validation and checkpoints due after a step; whether --max-time is up or a
        process was sent a stopping signal (then all of them stop at this step)."""
        args, state = self.args, s.state
        now = time.perf_counter()
        state.elapsed = s.elapsed_before + (now - s.started)
        if self.step_hook is not None:
            self.step_hook(state.step)
        if state.step % args.log_every == 0:
            self._flush_tokens(s)
            self._log_window(s)
        if args.eval_every and state.step % args.eval_every == 0:
            self._validate(s)
        if self._checkpoint_due(s, now):
            self._flush_tokens(s)
            self._check_finite_weights(s)  # a step's finite gradients can still take a weight past float32
            self._save(s)
            s.last_checkpoint = time.perf_counter()
        s.stopped_by = int(s.ctx.max(float(s.stop_request.signum or 0)))
        s.stopped_for_time = args.max_time is not None and _any_process(s.ctx, now - s.started >= args.max_time)

    def _checkpoint_due(self, s: Session, now: float) -> bool:
        args = self.args
        due = s.state.step % args.checkpoint_every == 0 if args.checkpoint_every else False
        if args.checkpoint_seconds is not None:
            due = _any_process(s.ctx, now - s.last_checkpoint >= args.checkpoint_seconds) or due
        return due

    def _finish(self, s: Session) -> dict[str, Any]:
        """The last log line and validation, model/, the final checkpoint."""
        args, ctx, state = self.args, s.ctx, s.state
        if s.window.steps and not s.stopped_by:  # after a signal the checkpoint carries the window
            self._flush_tokens(s)
            self._log_window(s)
        finished = not (s.stopped_for_time or s.stopped_by)
        # also when stopped for time: best/ then always reflects the last weights too; not after a
        # signal, whose sender may give seconds only (a container's grace period) before SIGKILL.
        # At step 0 (--max-steps 0) the loop validated nothing: the starting model is validated.
        validated_in_loop = bool(state.step and args.eval_every and state.step % args.eval_every == 0)
        if args.valid and not s.stopped_by and not validated_in_loop:
            self._validate(s)
        state.done = finished
        state.finished_under = [args.epochs, args.max_steps] if finished else None
        self._flush_tokens(s)
        self._check_finite_weights(s)  # before model/ and the final checkpoint
        if finished and ctx.is_main:
            # model/ before the checkpoint that marks the run done: killed in between, the run is
            # not done, and the same command redoes the steps after its last checkpoint and this.
            replace_folder(self.model_dir, s.model.save_pretrained)
        existing = ckpt.latest_checkpoint(args.output)
        if existing is None or not existing.endswith(ckpt.checkpoint_name(state.step)) or finished:
            self._save(s, final=finished)
        if finished:
            self.log(f"finished: {state.step} steps, {state.tokens:,} tokens, model in {self.model_dir}")
        elif not s.stopped_by:
            self.log(f"stopped at the time limit after step {state.step}; run the same command to continue")
        return state.result()

    # -- validation, checkpoints, logging ---------------------------------------------------------
    def _validate(self, s: Session) -> None:
        """Held-out perplexity; an improvement is published to best/."""
        args, state = self.args, s.state
        if not args.valid:
            return
        self._flush_tokens(s)  # the row's tokens are those trained on by this step, not by the last log line
        try:
            result = self._evaluate_valid(s, s.model)
        except NonFinitePerplexity as exc:
            raise TrainingDiverged(f"validation at step {state.step}: {exc}; the run stops here, not done. "
                                   f"{self._what_to_do()}") from exc
        ppl = result["average_perplexity"]
        improved = state.best_valid is None or ppl < state.best_valid
        self.log(f"valid step {state.step}: perplexity {ppl:.2f} (forward {result['forward_perplexity']:.2f}, "
                 f"backward {result['backward_perplexity']:.2f}){' *best*' if improved else ''}")
        s.metrics.write({"kind": "valid", "step": state.step, "epoch": state.position.epoch,
                         "elapsed_s": round(state.elapsed, 1), "tokens": state.tokens,
                         "loss": round(0.5 * (result["forward_nll"] + result["backward_nll"]), 5),
                         "perplexity": round(ppl, 3), "forward_perplexity": round(result["forward_perplexity"], 3),
                         "backward_perplexity": round(result["backward_perplexity"], 3)})
        if improved:
            state.best_valid, state.best_step, state.best_data = ppl, state.step, valid_shown(args.valid)
            if s.ctx.is_main:
                replace_folder(self.best_dir, partial(_write_best, s.model, {**result, "step": state.step,
                                                                           "data": state.best_data}))

    def _evaluate_valid(self, s: Session, model: BiLM) -> dict[str, Any]:
        """--valid's figures for `model`. Their time is left out of the log window's, so that its
        tokens/s is the training's: the row after a validation on WikiText-2 valid showed 600
        tokens/s where the others showed 1,100 to 1,600."""
        args = self.args
        began = time.perf_counter()
        try:
            return evaluate_sentences(model, data_sentences(model, args.valid, args.valid_tokenizer),
                                      args.eval_batch_tokens, s.ctx.device, s.precision)
        finally:
            s.window.started += time.perf_counter() - began

    def _judge_best_on_this_valid(self, s: Session) -> None:
        """A run resumed with another --valid compared this data's perplexities with best/'s on the
        earlier data, and kept or replaced best/ by that; best/ is evaluated on this data first."""
        args, state = self.args, s.state
        if not args.valid or state.best_valid is None or state.best_data in (None, valid_shown(args.valid)):
            return
        if not os.path.isdir(self.best_dir):  # removed by hand: the next validation writes it again
            state.best_valid = state.best_step = state.best_data = None
            return
        best = BiLM.from_pretrained(self.best_dir, kernel=s.model.kernel).to(s.ctx.device)
        result = self._evaluate_valid(s, best)
        self.log(f"note: best/ (step {state.best_step}) was judged on --valid {state.best_data}; on {args.valid} its "
                 f"perplexity is {result['average_perplexity']:.2f}, which this run's validations are compared with")
        state.best_valid, state.best_data = result["average_perplexity"], valid_shown(args.valid)
        s.ctx.barrier()  # every process has read best/ before the main one replaces it
        if s.ctx.is_main:
            replace_folder(self.best_dir, partial(_write_best, best, {**result, "step": state.best_step,
                                                                         "data": state.best_data}))

    def _save(self, s: Session, final: bool = False) -> None:
        """A checkpoint of this step: every process writes its random state, the main one the rest."""
        args, ctx, step = self.args, s.ctx, s.state.step
        s.state.window = _window_totals(ctx, s.window)
        s.state.batching = s.stream.batching()
        tmp = ckpt.begin_checkpoint(args.output, step) if ctx.is_main else None
        ctx.barrier()
        ckpt.write_rng(tmp or ckpt.temporary_dir(args.output, step), ctx.rank)
        ctx.barrier()
        if tmp is not None:
            path = ckpt.finish_checkpoint(args.output, step, tmp, s.model, s.optimizer, s.state.to_dict(),
                                          args.keep_checkpoints)
            self.log(f"checkpoint {path}{' (final)' if final else ''}")
        ctx.barrier()

    def _flush_tokens(self, s: Session) -> None:
        s.state.tokens += int(s.ctx.sum([float(s.pending_words)])[0])
        s.pending_words = 0

    def _log_window(self, s: Session) -> None:
        """The log line and metrics row of the steps since the last one, summed over processes."""
        window, state = s.window, s.state
        fwd, bwd, n, words = s.ctx.sum([window.fwd_nll, window.bwd_nll, float(window.predictions),
                                        float(window.words)])
        seconds = max(1e-9, time.perf_counter() - window.started)
        if n:
            fnll, bnll = fwd / n, bwd / n
            loss = 0.5 * (fnll + bnll)
            rate = words / seconds
            gnorm = window.grad_norm / max(1, window.steps)
            # this process's peak since it started (CUDA only: the allocator's own count, no sync)
            peak = torch.cuda.max_memory_allocated(s.ctx.device) / 2**30 if s.ctx.device.type == "cuda" else None
            # a sampled softmax's loss is over the sampled candidates only: its exp is no perplexity
            # (many times lower than the full softmax's); the valid rows give that one
            sampled = s.model.softmax.samples
            try:  # checked for a sampled loss too: past exp's range it is as diverged
                ppls = [perplexity(nll, direction) for nll, direction in ((loss, "average"), (fnll, "forward"),
                                                                          (bnll, "backward"))]
            except NonFinitePerplexity as exc:
                raise TrainingDiverged(f"training diverged by step {state.step}: {exc}; the run stops here, not done. "
                                       f"{self._what_to_do()}") from exc
            ppl = "" if sampled else f" | perplexity {ppls[0]:.2f} (forward {ppls[1]:.2f}, backward {ppls[2]:.2f})"
            self.log(f"step {state.step} | epoch {state.position.epoch} | {rate:,.0f} tokens/s | "
                     f"{'sampled loss' if sampled else 'loss'} {loss:.4f}{ppl}"
                     f" | lr {window.lr:.4g} | grad norm {gnorm:.3f}"
                     + (f" | peak {peak:.1f} GiB" if peak is not None else "") + f" | {_fmt_time(state.elapsed)}")
            s.metrics.write({"kind": "train", "step": state.step, "epoch": state.position.epoch,
                             "elapsed_s": round(state.elapsed, 1), "tokens": state.tokens,
                             "tokens_per_s": round(rate, 1), "loss": round(loss, 5),
                             **({} if sampled else dict(zip(("perplexity", "forward_perplexity", "backward_perplexity"),
                                                            (round(p, 3) for p in ppls)))),
                             "lr": window.lr, "grad_norm": round(gnorm, 4),
                             "peak_memory_gib": "" if peak is None else round(peak, 2)})
        s.window = Window()


def _objective(ctx: DistContext, model: BiLM) -> nn.Module:
    objective = LmObjective(model)
    if not ctx.enabled:
        return objective
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(objective, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
               find_unused_parameters=True)


def _clip_gradients(params: list[nn.Parameter], clip_norm: float | None) -> float:
    """The global gradient norm before clipping (clipped to `clip_norm` when given)."""
    if clip_norm:
        return float(torch.nn.utils.clip_grad_norm_(params, clip_norm))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params
                                                       if p.grad is not None])))


def _any_process(ctx: DistContext, flag: bool) -> bool:
    """`flag` of any process, so that all of them take the same branch (a collective with several)."""
    return ctx.max(float(flag)) > 0 if ctx.enabled else flag


def train(args: TrainArgs, **kwargs: Any) -> dict[str, Any]:
    return Trainer(args, **kwargs).run()
