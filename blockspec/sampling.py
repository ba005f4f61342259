"""Sampling parameters, the target's sampling distribution and the engine's random numbers.

One module owns "what distribution does the target sample from", because speculative
verification is only lossless when it accepts against exactly that distribution
(``speculative/accept.py`` calls :func:`target_probs`, :func:`uniforms` and
:func:`inverse_cdf_sample` from here).

Conventions shared by every tensor function below:

* Math is fp32 (probabilities) / fp64 (CDFs and uniforms) whatever the logits dtype.
* Rows are independent: a row's result depends only on its own logits, parameters and
  random numbers, never on which other rows share the batch.
* Greedy rows (``SamplingParams.is_greedy``) are encoded as temperature 0 and are decided by
  ``argmax`` of the raw logits (first maximum); random numbers given for them are ignored.
* Nothing here reads a device tensor back to the host, so every function can run inside a
  CUDA graph: the random numbers are a pure function of integers (:func:`uniforms`), not of
  generator state, and filters are applied with masks rather than by selecting rows.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch

from blockspec.kernels.triton_loader import use_triton
from blockspec.kernels.uniforms import uniforms_fused
from blockspec.penalties import penalty_error, uses_penalties

__all__ = ["SamplingParams", "SamplingParamsError", "TOP_K_MAX", "SEED_LIMIT", "GREEDY_BELOW",
           "not_utf8", "target_probs", "params_to_tensors", "Stream", "uniforms", "request_seed",
           "inverse_cdf_sample", "sample", "logprobs_of"]

# What the step buffers can hold (runtime/metadata.py: int64 and float32 rows). top_k is
# bounded at int32 (any value >= the vocabulary already keeps every token); seeds are uint64
# (``request_seed`` stores them two's-complement); temperatures below GREEDY_BELOW are greedy,
# since dividing logits by a smaller float32 overflows to inf and the softmax to NaN.
TOP_K_MAX = 2**31 - 1
SEED_LIMIT = 2**64
FLOAT32_MAX = 3.4028234663852886e38
GREEDY_BELOW = 1e-5


class SamplingParamsError(ValueError):
    """A request's sampling parameters are malformed; the message names the field and
    ``param`` is that field (None when the error is about the whole dict)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def not_utf8(text: str) -> int | None:
    """Index of the first character of ``text`` that UTF-8 cannot encode (a lone surrogate,
    as JSON's "\\ud800" or a non-UTF-8 byte in argv decodes to), else None. Tokenizers and
    response encoders fail on those, so every text field is checked where it comes in."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _show(x: Any) -> str:
    """A value for an error message: huge ints are summarised (str() of an int past 4300
    digits raises, and a message should stay one readable line)."""
    if _is_int(x) and x.bit_length() > 128:
        return f"an int of {x.bit_length()} bits"
    return repr(x)


def _finite(x: Any) -> bool:
    """A real number a float holds (an int past 1.8e308, as JSON allows, is not)."""
    try:
        return _is_real(x) and math.isfinite(x)
    except OverflowError:
        return False


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
    # structured output (blockspec/grammar.py), at most one: a JSON schema (text or dict), any
    # JSON object, a regular expression, or an EBNF grammar with a ``root`` rule
    json_schema: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    ebnf: str | None = None
    # logit processing on the device (blockspec/penalties.py): OpenAI's presence / frequency
    # penalties, vLLM's repetition_penalty, token id -> bias, sglang's min_new_tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_new_tokens: int = 0

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
        def bad(param: str, msg: str) -> SamplingParamsError:
            return SamplingParamsError(msg, param)

        if not _is_int(self.max_new_tokens):
            raise bad("max_new_tokens", "max_new_tokens must be an int, "
                                        f"got {type(self.max_new_tokens).__name__}")
        if self.max_new_tokens < 0:
            raise bad("max_new_tokens", f"max_new_tokens must be >= 0, got {_show(self.max_new_tokens)}")

        if not _finite(self.temperature):
            raise bad("temperature", "temperature must be a finite number >= 0, "
                                     f"got {_show(self.temperature)}")
        if self.temperature < 0:
            raise bad("temperature", f"temperature must be >= 0, got {_show(self.temperature)}")
        if self.temperature > FLOAT32_MAX:
            raise bad("temperature", f"temperature must be at most {FLOAT32_MAX:g} (a float32), "
                                     f"got {_show(self.temperature)}")

        if not _finite(self.top_p):
            raise bad("top_p", f"top_p must be a number in (0, 1], got {_show(self.top_p)}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"top_p must be in (0, 1], got {_show(self.top_p)}")

        if not _is_int(self.top_k):
            raise bad("top_k", f"top_k must be an int (-1 = off, or >= 1), got {_show(self.top_k)}")
        if self.top_k == 0:
            raise bad("top_k", "top_k must be -1 (off) or >= 1, got 0 (0 is not 'off'; use -1)")
        if self.top_k < -1:
            raise bad("top_k", f"top_k must be -1 (off) or >= 1, got {_show(self.top_k)}")
        if self.top_k > TOP_K_MAX:
            raise bad("top_k", "top_k must be at most 2**31 - 1 (a value >= the vocabulary "
                               f"keeps every token), got {_show(self.top_k)}")

        if not _finite(self.min_p):
            raise bad("min_p", f"min_p must be a number in [0, 1], got {_show(self.min_p)}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"min_p must be in [0, 1], got {_show(self.min_p)}")

        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)):
                raise bad("stop", "stop must be a string, a list of strings or None, "
                                  f"got {type(self.stop).__name__}")
            for i, s in enumerate(stops):
                if not isinstance(s, str):
                    raise bad("stop", f"stop[{i}] must be a string, got {type(s).__name__}")
                if not s:
                    raise bad("stop", f"stop strings must be non-empty, stop[{i}] is ''")
                at = not_utf8(s)
                if at is not None:
                    raise bad("stop", f"stop[{i}] is not UTF-8 text: character {at} is "
                                      f"{s[at]!r} (a lone surrogate)")

        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise bad("stop_token_ids", "stop_token_ids must be a list of ints or None, "
                                            f"got {type(self.stop_token_ids).__name__}")
            for i, t in enumerate(self.stop_token_ids):
                if not _is_int(t) or t < 0:
                    raise bad("stop_token_ids",
                              f"stop_token_ids[{i}] must be an int >= 0, got {_show(t)}")

        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos",
                      f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

        if self.seed is not None:
            if not _is_int(self.seed):
                raise bad("seed", f"seed must be an int or None, got {type(self.seed).__name__}")
            if not 0 <= self.seed < SEED_LIMIT:
                raise bad("seed", f"seed must be in [0, 2**64), got {_show(self.seed)}")
        found = penalty_error(self)
        if found is not None:
            raise bad(*found)
        self.constraint()

    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the structured-output constraint, or None: the key its compiled
        grammar is cached under. The shape is checked here; whether it compiles is checked
        against the tokenizer when the request is submitted."""
        given = [k for k, v in (("json_schema", self.json_schema), ("regex", self.regex),
                                ("ebnf", self.ebnf)) if v is not None]
        if not isinstance(self.json_object, bool):
            raise SamplingParamsError(f"json_object must be a bool, got "
                                      f"{type(self.json_object).__name__}", "json_object")
        given += ["json_object"] if self.json_object else []
        if len(given) > 1:
            raise SamplingParamsError(f"give at most one of json_schema, json_object, regex, ebnf; "
                                      f"got {', '.join(given)}", given[1])
        if not given:
            return None
        kind = given[0]
        if kind == "json_object":
            return kind, ""
        value = getattr(self, kind)
        if kind == "json_schema" and isinstance(value, dict):
            try:
                value = json.dumps(value)     # key order kept: it is the properties' order
            except (TypeError, ValueError) as e:
                raise SamplingParamsError(f"json_schema: not JSON-serialisable: {e}",
                                          "json_schema") from None
        if not isinstance(value, str):
            raise SamplingParamsError(f"{kind} must be a string"
                                      f"{' or a dict' if kind == 'json_schema' else ''}, "
                                      f"got {type(value).__name__}", kind)
        if not value.strip():
            raise SamplingParamsError(f"{kind} must not be empty", kind)
        return kind, value

    @property
    def is_greedy(self) -> bool:
        """Greedy rows are argmax-decoded and verified with exact-match acceptance; so are
        temperatures below GREEDY_BELOW (their tempered logits overflow float32)."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return uses_penalties(self)

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
                 top_p: torch.Tensor, min_p: torch.Tensor, filters: bool = True) -> torch.Tensor:
    """The distribution the target actually samples from, [N, V] fp32.

    temperature == 0 rows: one-hot at argmax of the raw logits (first maximum).
    Other rows: softmax(logits / T), then top-k -> top-p -> min-p (see ``_filter_rows``),
    renormalised. Rows with no active filter are the plain tempered softmax (not
    re-divided by their sum), so a row's bits do not depend on its neighbours' filters.
    top_k <= 0 or >= V means off; top_p >= 1 off; min_p <= 0 off.

    ``filters=False`` skips the filter pass (a sort over the vocabulary) when the caller
    knows from the host-side parameters that no row has a filter on; the result is then
    identical to ``filters=True``. No row is selected by a data-dependent index, so the
    function never waits for the device.
    """
    if logits.dim() != 2:
        raise ValueError(f"target_probs expects logits [N, V], got shape {tuple(logits.shape)}")
    x = logits.float()
    vocab = x.shape[1]
    dev = x.device
    temperature = temperature.to(dev, torch.float32)
    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(x / safe_t[:, None], dim=-1)
    if filters:
        top_k = top_k.to(dev, torch.long)
        top_p = top_p.to(dev, torch.float32)
        min_p = min_p.to(dev, torch.float32)
        need = ~greedy & (((top_k > 0) & (top_k < vocab)) | (top_p < 1) | (min_p > 0))
        probs = torch.where(need[:, None], _filter_rows(probs, top_k, top_p, min_p), probs)
    one_hot = torch.zeros_like(probs).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


# ---------------------------------------------------------------- random numbers

class Stream:
    """Independent streams of one request's random numbers (the ``stream`` of :func:`uniforms`).
    Each (stream, counter) pair is used once per request, so no uniform is ever reused: a
    uniform that decided one token must not also decide a later one (that would bias the
    draft's proposal law and with it the rejection sampler)."""

    SAMPLE = 0      # counter = output tokens so far: the token sampled after them
    COIN = 1        # counter = verify steps so far; index j = acceptance coin of draft j
    BONUS = 2       # counter = verify steps so far; the bonus / residual draw
    DRAFT = 3       # counter = verify steps so far; index k = DSpark Markov-walk slot k
    SIMULATE = 4    # counter = verify steps so far; benchmark's simulated acceptance coins
    TEXT = 5        # counter = output index; benchmark's simulated text (simulated_text.py)


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without int64 overflow: the
    constant is applied as two 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (the 'lowbias32' xorshift-multiply construction): every input
    bit affects every output bit, so consecutive counters give unrelated outputs."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor, stream: int, width: int) -> torch.Tensor:
    """``uniforms_reference``'s numbers: one Triton launch on CUDA (``kernels/uniforms.py``),
    the torch code elsewhere."""
    if use_triton(seeds):
        return uniforms_fused(seeds, counters, stream, width)
    return uniforms_reference(seeds, counters, stream, width)


def uniforms_reference(seeds: torch.Tensor, counters: torch.Tensor, stream: int,
                       width: int) -> torch.Tensor:
    """U[0, 1) fp64 uniforms [N, width]: ``u[i, j]`` is a pure function of
    (seeds[i], stream, counters[i], j).

    Counter-based rather than generator-based: a seeded request gets the same numbers alone
    or in any batch, on CPU and GPU alike (integer arithmetic is exact on both), and no
    generator state has to live on the host, so sampling can be captured in a CUDA graph.
    Each uniform carries 53 random bits from two 32-bit hashes. ``seeds`` are int64 (any
    value; a uint64 seed is stored two's-complement); ``counters`` are below 2**32.
    """
    seeds = seeds.to(torch.int64)
    dev = seeds.device
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    # distinct odd constants per stage keep the all-zero input away from hash32's fixed point 0
    h = _hash32(_hash32(lo ^ 0x6A09E667) ^ hi ^ 0xBB67AE85)
    h = _hash32(h ^ (counters.to(dev, torch.int64) & _M32) ^ 0x3C6EF372)
    col = torch.arange(width, device=dev, dtype=torch.int64) + (stream << 16)
    h = _hash32(h[:, None] ^ _hash32(col ^ 0xA54FF53A)[None, :])
    h2 = _hash32(h ^ 0x9E3779B9)
    bits = (h >> 5) * (1 << 26) + (h2 >> 6)
    return bits.to(torch.float64) * (2.0 ** -53)


_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of the splitmix64 mixer on a Python int (exact 64-bit arithmetic)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def request_seed(seed: int | None, default_seed: int, request_id: int) -> int:
    """The int64 seed a request samples with: its own ``seed``, or one derived from the
    engine's ``random_seed`` and the request's number (so unseeded runs are reproducible from
    ``--random-seed``). uint64 seeds map to int64 two's-complement."""
    if seed is None:
        seed = _splitmix64(_splitmix64(default_seed & _M64) ^ (request_id & _M64))
    seed = int(seed) & _M64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def inverse_cdf_sample(weights: torch.Tensor, u: torch.Tensor, check: bool = False) -> torch.Tensor:
    """Token per row by inverse CDF: the first index whose cumulative weight exceeds u * total.

    Weights need not be normalised. The CDF is fp64 and u * total is kept strictly below the
    total (even for u == 1), so a zero-weight token can never be returned: its CDF equals its
    predecessor's, so the predecessor is found first. ``check=True`` raises on rows without
    mass (it reads the device, so the engine's hot path leaves it off).
    """
    w = weights.double().clamp_min(0.0)
    cdf = torch.cumsum(w, dim=-1)
    total = cdf[:, -1:]
    if check:
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


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor | None, *,
           greedy_only: bool = False, filters: bool = True) -> torch.Tensor:
    """Next token per row [N] (long): greedy rows (temperature 0) take the argmax of the raw
    logits, the others invert the CDF of :func:`target_probs` at their uniform ``u`` [N].

    ``greedy_only`` / ``filters=False`` are host-side promises (from the requests'
    parameters) that let the caller skip the softmax or the filter sort (``u`` may then be
    None); they never change a result.
    """
    argmax = logits.argmax(-1)
    if greedy_only:
        return argmax
    if u is None or not (logits.shape[0] == temperature.shape[0] == u.shape[0]):
        raise ValueError(f"sample: {logits.shape[0]} logits rows, {temperature.shape[0]} "
                         f"parameter rows, {None if u is None else u.shape[0]} uniforms")
    probs = target_probs(logits, temperature, top_k, top_p, min_p, filters=filters)
    drawn = inverse_cdf_sample(probs, u)
    return torch.where(temperature.to(logits.device) <= 0, argmax, drawn)


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
