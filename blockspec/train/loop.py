"""What target and draft training share: the device/precision choice, a wall-clock budget with a
time-based learning-rate schedule, resumable training state, and progress reporting.

The schedule runs on *time*, not steps: a run is given seconds, not a step count, because the
same command must end in budget on an H200 and in a CPU smoke test.  Warm-up and cosine decay
are laid over the budget, so the learning rate reaches its floor exactly when time is up,
whatever the throughput turned out to be.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from blockspec.engine.engine import resolve_device

STATE_FILE = "train_state.pt"


def pick_device(name: str = "auto") -> torch.device:
    """The engine's device rule (auto = cuda when available), for the trainers' --device."""
    return resolve_device(name)


def autocast(device: torch.device):
    """bf16 autocast on CUDA (fp32 master weights); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def configure_backends(device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


@dataclass
class Budget:
    """Wall-clock budget for the optimisation loop, carried across resumes.

    ``elapsed`` counts only training time (not start-up or saving); ``max_steps`` optionally
    ends a run earlier (tests).  ``progress`` in [0, 1] drives the schedule.
    """

    seconds: float
    max_steps: int | None = None
    elapsed: float = 0.0
    step: int = 0
    _t0: float | None = field(default=None, repr=False)

    def start(self) -> None:
        self._t0 = time.monotonic() - self.elapsed

    def tick(self) -> None:
        self.step += 1
        if self._t0 is not None:
            self.elapsed = time.monotonic() - self._t0

    @property
    def progress(self) -> float:
        p = self.elapsed / self.seconds if self.seconds > 0 else 1.0
        if self.max_steps:
            p = max(p, self.step / self.max_steps)
        return min(1.0, p)

    @property
    def done(self) -> bool:
        return self.progress >= 1.0


def lr_at(progress: float, peak: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warm-up over the first ``warmup`` of the budget, then cosine down to
    ``floor * peak``."""
    if progress < warmup:
        return peak * max(progress / warmup, 0.02)
    t = (progress - warmup) / max(1e-9, 1.0 - warmup)
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t))))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)


def adamw(params: list[tuple[str, torch.nn.Parameter]], lr: float, weight_decay: float,
          device: torch.device) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (norms, biases and SSM scalars are not decayed)."""
    decay = [p for n, p in params if p.dim() >= 2]
    rest = [p for n, p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **kw)


def optimizer_step(opt: torch.optim.Optimizer, module: torch.nn.Module, loss: torch.Tensor,
                   max_norm: float = 1.0) -> bool:
    """backward, clip, step.  A non-finite gradient norm skips the step (returns False), so one
    bad batch cannot poison the weights; the caller counts the skips."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
    if not bool(torch.isfinite(norm)):
        opt.zero_grad(set_to_none=True)
        return False
    opt.step()
    return True


def save_state(folder: Path, **state) -> None:
    """Training state for ``--resume`` (written atomically next to the checkpoint)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, folder / STATE_FILE)


def load_state(folder: Path) -> dict:
    path = folder / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no {STATE_FILE} in {folder}")
    return torch.load(path, map_location="cpu", weights_only=False)


def resume(folder: Path, config: dict, what: str, model: torch.nn.Module, opt, order, budget) -> dict:
    """Restore a run saved by ``save_state`` (refusing one trained with another config):
    weights, optimizer, data order and elapsed budget. Returns the state for extra fields."""
    st = load_state(folder)
    if st.get("config") != config:
        raise ValueError(f"--resume: {folder} was trained with another {what} config")
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optimizer"])
    order.restore(st["order"])
    budget.elapsed, budget.step = st["elapsed"], st["step"]
    return st


class Reporter:
    """A tqdm bar over the time budget plus a plain log line every ``every_s`` seconds (the
    lines survive in captured logs where a bar does not)."""

    def __init__(self, what: str, budget: Budget, every_s: float = 10.0) -> None:
        self.what, self.budget, self.every_s = what, budget, every_s
        self.bar = tqdm(total=100, desc=what, unit="%", leave=False,
                        disable=not os.isatty(2))
        self._last = time.monotonic()
        self._tokens = 0
        self._loss_sum = 0.0
        self._loss_n = 0
        self.skipped = 0

    def update(self, loss: float, tokens: int, lr: float, stepped: bool = True) -> None:
        self.skipped += not stepped
        self._tokens += tokens
        self._loss_sum += loss
        self._loss_n += 1
        self.bar.n = int(self.budget.progress * 100)
        self.bar.set_postfix(loss=f"{loss:.3f}", step=self.budget.step)
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self.flush(lr, now)

    def flush(self, lr: float, now: float | None = None) -> None:
        now = now or time.monotonic()
        if self._loss_n:
            dt = max(1e-9, now - self._last)
            print(f"[{self.what}] step {self.budget.step} t={self.budget.elapsed:.0f}s "
                  f"loss {self._loss_sum / self._loss_n:.4f} lr {lr:.2e} "
                  f"{self._tokens / dt:,.0f} tok/s"
                  + (f" ({self.skipped} steps skipped: non-finite gradients)" if self.skipped else ""),
                  flush=True)
        self._last, self._tokens, self._loss_sum, self._loss_n = now, 0, 0.0, 0

    def close(self) -> None:
        self.bar.close()
