"""The bench's simulated-acceptance flags as data, without torch (``--help`` never loads it):
``--simulate-accept-profile`` (a comma list of per-position conditional acceptance
probabilities, or a named profile), ``--simulate-accept-length`` (its shorthand) and
``--simulate-low-accept-phases``, plus the means and per-position rates they imply.

A profile ``p`` gives ``p[i-1]`` = P(draft i accepted | drafts 1..i-1 accepted); a verify of
γ drafts then commits on average 1 + Σ_{k≤γ} Π_{i≤k} p_i tokens (bonus included).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

PROFILE_FLAG = "--simulate-accept-profile"
LENGTH_FLAG = "--simulate-accept-length"
PHASES_FLAG = "--simulate-low-accept-phases"
TEXT_FLAG = "--simulate-text"

# dflash-published: p_i = 0.9274 - 0.06 (i - 1), the start chosen so that width 6 (5 drafts)
# commits 4.20 per verify, the accept length reported for Nemotron 3.5 Lightning's DFlash draft
# that --simulate-accept-length 4.2 stands for (docs/benchmarks.md); the decay is assumed.
# dspark-published: p_i = 0.968 - 0.03 (i - 1), 3.70 at width 4 (DSpark's reported 3.7).
# demo-measured: the shipped demo DFlash draft at verify width 8 on the 500 GSM8K test
# questions (CPU eval of 2026-11-30, accept histogram [40, 67, 83, 126, 99, 120, 177, 3646]);
# demo-nvfp4-measured: its Nemotron-3.5-layout NVFP4 draft, histogram
# [1519, 588, 670, 828, 903, 759, 631, 1383] (docs/logs/eval_demo_cpu_results_2026-11-30.jsonl).
NAMED_PROFILES: dict[str, tuple[float, ...]] = {
    "dflash-published": (0.9274, 0.8674, 0.8074, 0.7474, 0.6874, 0.6274, 0.5674),
    "dspark-published": (0.968, 0.938, 0.908, 0.878, 0.848, 0.818, 0.788),
    "demo-measured": (0.991, 0.984, 0.980, 0.970, 0.976, 0.970, 0.954),
    "demo-nvfp4-measured": (0.791, 0.898, 0.871, 0.816, 0.754, 0.726, 0.687),
}


@dataclass(frozen=True)
class LowAcceptPhases:
    """Every ``every`` verify steps of a request, the last ``length`` scale each probability."""

    every: int
    length: int
    scale: float

    def low_steps(self, steps: int) -> int:
        """How many of a request's first ``steps`` verifies fall in a low phase."""
        full, rest = divmod(steps, self.every)
        return full * self.length + max(0, rest - (self.every - self.length))


def parse_profile(text: str) -> tuple[str | None, tuple[float, ...]]:
    """(name or None, probabilities) of a ``--simulate-accept-profile`` value."""
    text = text.strip()
    if text in NAMED_PROFILES:
        return text, NAMED_PROFILES[text]
    try:
        probs = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{PROFILE_FLAG}: expected a comma list of probabilities in [0, 1] or "
                         f"one of {', '.join(NAMED_PROFILES)}, got {text!r}") from None
    bad = [p for p in probs if not (math.isfinite(p) and 0.0 <= p <= 1.0)]
    if bad:
        raise ValueError(f"{PROFILE_FLAG}: every probability must be in [0, 1], got "
                         f"{', '.join(map(str, bad))} in {text!r}")
    return None, probs


def parse_phases(text: str) -> LowAcceptPhases:
    """``every=N,len=L,scale=S`` (1 <= L < N, 0 <= S <= 1)."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("every", "len", "scale") or key.strip() in fields:
            raise ValueError(f"{PHASES_FLAG}: expected every=N,len=L,scale=S (each once), got "
                             f"{text!r}")
        fields[key.strip()] = value.strip()
    if len(fields) != 3:
        missing = sorted({"every", "len", "scale"} - set(fields))
        raise ValueError(f"{PHASES_FLAG}: missing {', '.join(missing)} in {text!r}")
    try:
        every, length, scale = int(fields["every"]), int(fields["len"]), float(fields["scale"])
    except ValueError:
        raise ValueError(f"{PHASES_FLAG}: every and len must be integers and scale a number, "
                         f"got {text!r}") from None
    if not 1 <= length < every:
        raise ValueError(f"{PHASES_FLAG}: len must be in [1, every - 1], got len={length} "
                         f"every={every}")
    if not (math.isfinite(scale) and 0.0 <= scale <= 1.0):
        raise ValueError(f"{PHASES_FLAG}: scale must be in [0, 1], got {scale}")
    return LowAcceptPhases(every, length, scale)


def accept_length_profile(tau: float, gamma: int) -> tuple[float, ...]:
    """``--simulate-accept-length TAU`` as a profile of γ positions: floor(TAU-1) drafts always,
    one more with the fractional part's probability, none after."""
    if not 1.0 <= tau <= gamma + 1:
        raise ValueError(f"{LENGTH_FLAG} must be in [1, {gamma + 1}] (the verify width), got {tau}")
    whole = int(tau - 1.0)
    frac = tau - 1.0 - whole
    return tuple(1.0 if i < whole else frac if i == whole else 0.0 for i in range(gamma))


def survival(probs: tuple[float, ...], gamma: int, scale: float = 1.0) -> list[float]:
    """P(a >= k) for k = 0..γ: the share of verifies accepting at least k drafts."""
    out, run = [1.0], 1.0
    for p in probs[:gamma]:
        run *= p * scale
        out.append(run)
    return out


def mean_accept_length(probs: tuple[float, ...], gamma: int) -> float:
    """Mean tokens committed per verify of γ drafts (bonus included)."""
    return sum(survival(probs, gamma))


def expected_rates(probs: tuple[float, ...], gamma: int, phases: LowAcceptPhases | None,
                   high_steps: int, low_steps: int) -> tuple[float, list[float | None]]:
    """(mean committed length, conditional per-position rates) expected over ``high_steps``
    verifies at the profile and ``low_steps`` at its scaled copy."""
    hi = survival(probs, gamma)
    lo = survival(probs, gamma, phases.scale) if phases is not None else hi
    total = high_steps + low_steps
    if total == 0:
        return 0.0, [None] * gamma
    mix = [(high_steps * h + low_steps * lw) / total for h, lw in zip(hi, lo)]
    return sum(mix), conditional_rates(mix)


def conditional_rates(at_least: list[float]) -> list[float | None]:
    """P(a >= k | a >= k-1) for k = 1.. from P(a >= k) (or counts) for k = 0.."""
    return [at_least[k] / at_least[k - 1] if at_least[k - 1] else None
            for k in range(1, len(at_least))]


def histogram_rates(histogram: list[int]) -> list[float | None]:
    """Realised conditional per-position rates of an accept histogram (index a = verifies
    that accepted a drafts)."""
    at_least = [sum(histogram[k:]) for k in range(len(histogram))]
    return conditional_rates(at_least)


@dataclass(frozen=True)
class Simulation:
    """The bench's resolved simulation: the γ probabilities a verify uses, how they were
    given (a name, else the list; for the TAU shorthand the step profile it stands for) and
    the low-acceptance phases."""

    label: str | list[float]
    probs: tuple[float, ...]
    phases: LowAcceptPhases | None


def check_simulation_flags(profile: str | None, length: float | None, phases: str | None,
                           json_schema: str | None, text: bool = False) -> None:
    """Refuse contradictory or malformed simulation flags before anything is built."""
    if profile is not None:
        parse_profile(profile)
    if phases is not None:
        parse_phases(phases)
    if profile is not None and length is not None:
        raise ValueError(f"{PROFILE_FLAG} and {LENGTH_FLAG} contradict each other ({LENGTH_FLAG} "
                         f"is the shorthand for a step profile): give one of them")
    if phases is not None and profile is None and length is None:
        raise ValueError(f"{PHASES_FLAG} scales a simulated acceptance: give {PROFILE_FLAG} or "
                         f"{LENGTH_FLAG} with it")
    given = (PROFILE_FLAG if profile is not None else LENGTH_FLAG if length is not None
             else TEXT_FLAG if text else None)
    if given and json_schema:
        raise ValueError(f"{given} cannot be combined with --json-schema: the simulated "
                         f"text, proposals and acceptance ignore the grammar")


def resolve_simulation(profile: str | None, length: float | None, phases: str | None,
                       gamma: int) -> Simulation | None:
    """The simulation of a verify of γ drafts, or None when none is asked."""
    low = parse_phases(phases) if phases is not None else None
    if length is not None:
        probs = accept_length_profile(length, gamma)
        return Simulation(list(probs), probs, low)
    if profile is None:
        return None
    name, probs = parse_profile(profile)
    if len(probs) < gamma:
        raise ValueError(f"{PROFILE_FLAG} gives {len(probs)} positions, but the verify block has "
                         f"{gamma} drafts (width {gamma + 1}): give at least {gamma}")
    return Simulation(name if name is not None else list(probs), probs[:gamma], low)
