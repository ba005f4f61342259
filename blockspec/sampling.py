"""Sampling parameters and the target's sampling distribution.

One module owns "what distribution does the target sample from", because speculative
verification is only lossless when it accepts against exactly that distribution
(``speculative/accept.py`` calls :func:`target_probs`, :func:`draw_uniforms` and
:func:`inverse_cdf_sample` from here).

Conventions shared by every tensor function below:

* Math is fp32 (probabilities) / fp64 (CDFs and uniforms) whatever the logits dtype.
* Rows are independent: a row's result depends only on its own logits, parameters and
  generator, never on which other rows share the batch.
* Greedy rows (``SamplingParams.is_greedy``) are encoded as temperature 0 and are decided by
  ``argmax`` of the raw logits (first maximum); they consume no randomness.
* Randomness: row ``i`` draws only from ``generators[i]``; rows whose generator is ``None``
  share the caller's ``fallback`` generator (torch's default generator when that is ``None``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch

__all__ = [
    "SamplingParams",
    "SamplingParamsError",
    "target_probs",
    "params_to_tensors",
    "draw_uniforms",
    "inverse_cdf_sample",
    "sample_from_probs",
    "sample",
    "logprobs_of",
    "make_generator",
]

_SEED_LIMIT = 2**64  # torch.Generator.manual_seed accepts seeds below this


class SamplingParamsError(ValueError):
    """A request's sampling parameters are malformed; the message names the field."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Per-request sampling settings (field names and meanings follow sglang)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingParams":
        """Build and validate from a request dict; unknown keys are errors, not ignored,
        so a typo such as ``top-p`` cannot silently fall back to the default."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise SamplingParamsError(
                f"sampling_params must be a dict or None, got {type(d).__name__}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(k for k in d if k not in allowed)
        if unknown:
            raise SamplingParamsError(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; "
                f"allowed keys: {', '.join(allowed)}")
        params = cls(**d)
        params.validate()
        return params

    def validate(self) -> None:
        """Raise SamplingParamsError naming the first bad field and what was expected."""
        def bad(msg: str) -> SamplingParamsError:
            return SamplingParamsError(msg)

        if not _is_int(self.max_new_tokens):
            raise bad(f"max_new_tokens must be an int, got {type(self.max_new_tokens).__name__}")
        if self.max_new_tokens < 0:
            raise bad(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")

        if not _is_real(self.temperature) or not math.isfinite(self.temperature):
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")

        if not _is_real(self.top_p) or not math.isfinite(self.top_p):
            raise bad(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")

        if not _is_int(self.top_k):
            raise bad(f"top_k must be an int (-1 = off, or >= 1), got {self.top_k!r}")
        if self.top_k == 0:
            raise bad("top_k must be -1 (off) or >= 1, got 0 (0 is not 'off'; use -1)")
        if self.top_k < -1:
            raise bad(f"top_k must be -1 (off) or >= 1, got {self.top_k}")

        if not _is_real(self.min_p) or not math.isfinite(self.min_p):
            raise bad(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")

        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)):
                raise bad(f"stop must be a string, a list of strings or None, "
                          f"got {type(self.stop).__name__}")
            for i, s in enumerate(stops):
                if not isinstance(s, str):
                    raise bad(f"stop[{i}] must be a string, got {type(s).__name__}")
                if not s:
                    raise bad(f"stop strings must be non-empty, stop[{i}] is ''")

        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise bad(f"stop_token_ids must be a list of ints or None, "
                          f"got {type(self.stop_token_ids).__name__}")
            for i, t in enumerate(self.stop_token_ids):
                if not _is_int(t) or t < 0:
                    raise bad(f"stop_token_ids[{i}] must be an int >= 0, got {t!r}")

        if not isinstance(self.ignore_eos, bool):
            raise bad(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

        if self.seed is not None:
            if not _is_int(self.seed):
                raise bad(f"seed must be an int or None, got {type(self.seed).__name__}")
            if not 0 <= self.seed < _SEED_LIMIT:
                raise bad(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        """Greedy rows are argmax-decoded and verified with exact-match acceptance."""
        return self.temperature == 0 or self.top_k == 1

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)


def params_to_tensors(
    params: Sequence[SamplingParams], device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature f32, top_k i64, top_p f32, min_p f32), each [N].

    Greedy rows (including top_k == 1 at any temperature) get temperature 0 so every
    consumer treats them identically: argmax of the raw logits, no randomness."""
    temp = [0.0 if p.is_greedy else float(p.temperature) for p in params]
    return (
        torch.tensor(temp, dtype=torch.float32, device=device),
        torch.tensor([int(p.top_k) for p in params], dtype=torch.long, device=device),
        torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device),
        torch.tensor([float(p.min_p) for p in params], dtype=torch.float32, device=device),
    )


def _filter_rows(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """Apply top-k, then top-p, then min-p to rows of tempered probabilities; renormalise.

    Order and semantics (flashinfer/sglang renorm chain, HF warpers agree):
      1. top-k: keep the k most probable tokens (ties broken towards the lower token id).
      2. top-p: on the top-k distribution renormalised, keep the smallest prefix (in
         descending probability) whose mass is >= top_p; the top token is always kept.
      3. min-p: drop tokens with p < min_p * p_max. p_max is the top token, which steps 1-2
         never drop, so the ratio is the same before or after renormalising.
    """
    vocab = probs.shape[-1]
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=probs.device)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    keep = rank[None, :] < k[:, None]

    # top-p in fp64 so the prefix masses are not at the mercy of fp32 cumsum rounding.
    kept = torch.where(keep, sorted_p.double(), 0.0)
    kept = kept / kept.sum(-1, keepdim=True)
    cum = torch.cumsum(kept, dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # mass ranked above
    p_on = (top_p < 1)[:, None]
    keep = keep & ~(p_on & (before >= top_p.double()[:, None]))

    keep = keep & (sorted_p >= min_p[:, None] * sorted_p[:, :1])
    keep[:, 0] = True

    mask = torch.zeros_like(keep).scatter(1, order, keep)
    out = torch.where(mask, probs, 0.0)
    return out / out.sum(-1, keepdim=True)


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The distribution the target actually samples from, [N, V] fp32.

    temperature == 0 rows: one-hot at argmax of the raw logits (first maximum).
    Other rows: softmax(logits / T), then top-k -> top-p -> min-p (see ``_filter_rows``),
    renormalised. Rows with no active filter are the plain tempered softmax (not
    re-divided by their sum), so a row's bits do not depend on its neighbours' filters.
    top_k <= 0 or >= V means off; top_p >= 1 off; min_p <= 0 off.
    """
    if logits.dim() != 2:
        raise ValueError(f"target_probs expects logits [N, V], got shape {tuple(logits.shape)}")
    x = logits.float()
    n_rows, vocab = x.shape
    dev = x.device
    temperature = temperature.to(dev, torch.float32)
    top_k = top_k.to(dev, torch.long)
    top_p = top_p.to(dev, torch.float32)
    min_p = min_p.to(dev, torch.float32)

    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(x / safe_t[:, None], dim=-1)

    need = ~greedy & (((top_k > 0) & (top_k < vocab)) | (top_p < 1) | (min_p > 0))
    rows = need.nonzero().squeeze(1)
    if rows.numel():
        probs[rows] = _filter_rows(probs[rows], top_k[rows], top_p[rows], min_p[rows])

    if greedy.any():
        one_hot = torch.zeros_like(probs).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def draw_uniforms(generators: Sequence[torch.Generator | None], count: int,
                  fallback: torch.Generator | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """U[0, 1) fp64 uniforms, [N, count]; row i uses generators[i] only.

    Each row with its own generator makes exactly one ``torch.rand(count)`` call on it, so a
    seeded row gets the same numbers alone or in any batch. Rows whose generator is None (or
    is ``fallback`` itself) share one ``torch.rand(k, count)`` call on the fallback, filled
    in row order. A generator object shared by several rows is drawn in row order.
    """
    n = len(generators)
    out = torch.empty(n, count, dtype=torch.float64, device=device)
    if n == 0 or count == 0:
        return out
    shared: list[int] = []
    for i, g in enumerate(generators):
        if g is None or g is fallback:
            shared.append(i)
        else:
            out[i] = torch.rand(count, generator=g, device=g.device, dtype=torch.float64)
    if shared:
        fdev = fallback.device if fallback is not None else out.device
        u = torch.rand(len(shared), count, generator=fallback, device=fdev, dtype=torch.float64)
        out[torch.tensor(shared, device=out.device)] = u.to(out.device)
    return out


def inverse_cdf_sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token per row by inverse CDF: the first index whose cumulative weight exceeds u * total.

    Weights need not be normalised. The CDF is fp64 and u * total is kept strictly below the
    total (even for u == 1), so a zero-weight token can never be returned: its CDF equals its
    predecessor's, so the predecessor is found first. Rows without mass are an error.
    """
    w = weights.double().clamp_min(0.0)
    cdf = torch.cumsum(w, dim=-1)
    total = cdf[:, -1:]
    bad = ~(total[:, 0] > 0)
    if bad.any():
        rows = bad.nonzero().squeeze(1).tolist()
        raise ValueError(f"cannot sample: row(s) {rows} have no probability mass (zero or NaN)")
    target = u.to(cdf.device, torch.float64)[:, None] * total
    # u comes from [0, 1), but a u of exactly 1 (or rounding) must not run past the last token
    # with mass, which would land on a zero-weight tail token.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_max(weights.shape[-1] - 1)


def sample_from_probs(probs: torch.Tensor, generators: Sequence[torch.Generator | None],
                      fallback: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` [N, V]; one uniform per row (see ``draw_uniforms``)."""
    if len(generators) != probs.shape[0]:
        raise ValueError(f"sample_from_probs: {probs.shape[0]} rows but {len(generators)} generators")
    u = draw_uniforms(generators, 1, fallback, probs.device)[:, 0]
    return inverse_cdf_sample(probs, u)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None],
           fallback: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row [N] (long). Greedy rows take argmax of the raw logits and draw no
    uniform; the other rows draw one uniform each from their generator."""
    if not (logits.shape[0] == len(params) == len(generators)):
        raise ValueError(f"sample: {logits.shape[0]} logits rows, {len(params)} params, "
                         f"{len(generators)} generators")
    out = logits.float().argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        temperature, top_k, top_p, min_p = params_to_tensors([params[i] for i in rows], logits.device)
        probs = target_probs(logits[idx], temperature, top_k, top_p, min_p)
        out[idx] = sample_from_probs(probs, [generators[i] for i in rows], fallback)
    return out


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor,
                temperature: torch.Tensor | None = None) -> torch.Tensor:
    """log p(token) per row, fp32, from log_softmax of the logits.

    By default the raw logits (the model's own distribution, before temperature and
    filters): this is sglang's greedy path and its SGLANG_RETURN_ORIGINAL_LOGPROB=1 mode.
    (sglang's default for sampled rows is after temperature; pass ``temperature`` [N] to get
    that: rows with T > 0 are divided by T, T == 0 rows stay raw.)
    """
    x = logits.float()
    if temperature is not None:
        t = temperature.to(x.device, torch.float32)
        x = x / torch.where(t > 0, t, torch.ones_like(t))[:, None]
    lp = torch.log_softmax(x, dim=-1)
    return lp.gather(1, tokens.to(x.device).long()[:, None]).squeeze(1)


def make_generator(seed: int | None, device: torch.device | str = "cpu",
                   fallback: torch.Generator | None = None) -> torch.Generator | None:
    """A generator owned by one request: seeded requests get their own, so their tokens do
    not depend on batch neighbours; unseeded requests get ``fallback`` (possibly None, which
    the sampling functions also read as "use the fallback").

    A CPU generator is a fine choice even for GPU sampling: only a few uniforms per row are
    drawn, and the same seed then yields the same uniforms on every device."""
    if seed is None:
        return fallback
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g
