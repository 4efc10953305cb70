"""The optimizer and its learning rate: Adagrad (learning rate 0.2, initial accumulator 1.0,
as the original) or Adam; a linear warmup, then a constant, linear or cosine learning rate
(torch's LambdaLR). The learning rate is a function of the step count alone, so a checkpoint
holds no scheduler state and a resumed run rebuilds the schedule from its step.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from elmo_pipeline.training.options import OPTIMIZERS, TrainArgs


def base_lr(args: TrainArgs) -> float:
    if args.lr is not None:
        return args.lr
    return 0.2 if args.optimizer == "adagrad" else 1e-3


def lr_factor(args: TrainArgs, step: int, total: int | None) -> float:
    """Multiplier for the learning rate at optimizer step `step` (1-based)."""
    if args.warmup_steps and step <= args.warmup_steps:
        return step / args.warmup_steps
    if args.schedule == "constant" or not total:
        return 1.0
    span = max(1, total - args.warmup_steps)
    progress = min(1.0, max(0.0, (step - args.warmup_steps) / span))
    if args.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.min_lr_ratio + (1.0 - args.min_lr_ratio) * shape


def make_scheduler(args: TrainArgs, optimizer: torch.optim.Optimizer, total: int | None,
                   steps_done: int) -> LambdaLR:
    """`lr_factor` as torch's LambdaLR, to be stepped after each optimizer step.

    LambdaLR's epoch e is the optimizer step e + 1 (its constructor applies epoch 0, the LR of
    step 1). A resumed run passes its step count: the schedule depends on nothing else, so no
    scheduler state is stored, and checkpoints written before the scheduler existed resume too."""
    for group in optimizer.param_groups:
        group["initial_lr"] = base_lr(args)  # what LambdaLR scales; a restored group's lr is the last step's
    return LambdaLR(optimizer, partial(_step_factor, args, total), last_epoch=steps_done - 1)


def _step_factor(args: TrainArgs, total: int | None, epoch: int) -> float:
    return lr_factor(args, epoch + 1, total)


def make_optimizer(args: TrainArgs, model: nn.Module) -> torch.optim.Optimizer:
    if args.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}")
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=base_lr(args), initial_accumulator_value=args.adagrad_init,
                                   weight_decay=args.weight_decay)
    return torch.optim.Adam(params, lr=base_lr(args), weight_decay=args.weight_decay)
