"""One generation request's life: prompt, committed tokens, cache handles, stop state, stats."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from blockspec.cache import Reservation
from blockspec.grammar import Matcher
from blockspec.sampling import SamplingParams


@dataclass
class Mark:
    """A request's committed host state when a step began: what a failed step rolls back to
    (the scheduler then computes its cache state again from these tokens)."""

    outputs: int
    logprobs: int
    cached: int
    verifies: int
    histogram: list[int]
    first_token_time: float | None
    widths: list[int] = field(default_factory=list)


@dataclass
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    group: object = None                  # the client request it belongs to (fair admission)
    seed: int = 0                         # int64 sampling seed (its own or from random_seed)
    grammar: Matcher | None = None        # structured output: advanced by every committed token
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[tuple[float, int]] = field(default_factory=list)
    # top alternatives (logprob, id) per output token and prompt logprobs from position
    # ``logprob_start_len`` on (-1: none; position 0's is None), when asked (sglang's names)
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    cache: Reservation = field(default_factory=Reservation)
    num_cached: int = 0                   # tokens whose KV / Mamba state are committed
    cached_tokens: int | None = None      # prompt tokens resumed from the prefix cache
    finish_reason: dict | None = None
    text: str = ""
    # speculative decoding statistics
    spec_verify_ct: int = 0
    spec_accept_histogram: list[int] = field(default_factory=list)
    spec_width_histogram: list[int] = field(default_factory=list)   # steps per verify width
    # perf_counter timestamps (the scheduler stamps the first token and the finish)
    created_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finished_time: float | None = None

    failed_steps: int = 0                 # failed steps it was part of (fault isolation)

    @property
    def context_ids(self) -> list[int]:
        """The tokens a prefill puts in the cache: the prompt, and for a request computed
        again after a failed step also its output but the last token (the next step's input,
        as for any running request: committed = prompt + output - 1)."""
        return self.prompt_ids + self.output_ids[:-1] if self.output_ids else self.prompt_ids

    @property
    def prefilled(self) -> bool:
        return self.num_cached >= len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    def mark(self) -> Mark:
        return Mark(len(self.output_ids), len(self.output_logprobs), self.num_cached,
                    self.spec_verify_ct, list(self.spec_accept_histogram), self.first_token_time,
                    list(self.spec_width_histogram))

    def roll_back(self, mark: Mark) -> None:
        """Forget what a failed step added; the cache state is computed again (num_cached 0)."""
        del self.output_ids[mark.outputs:]
        del self.output_logprobs[mark.logprobs:]
        del self.output_top_logprobs[mark.logprobs:]
        self.spec_verify_ct, self.spec_accept_histogram = mark.verifies, list(mark.histogram)
        self.spec_width_histogram = list(mark.widths)
        self.first_token_time = mark.first_token_time
        self.finish_reason, self.text, self.finished_time = None, "", None
        self.num_cached = 0

    def count_verify(self, accepted: int, width: int, lookahead: int) -> None:
        """Speculative statistics of one verify: ``accepted`` drafts at verify ``width``."""
        self.spec_verify_ct += 1
        for hist, i in ((self.spec_accept_histogram, accepted), (self.spec_width_histogram, width - 1)):
            if not hist:
                hist.extend([0] * lookahead)
            hist[i] += 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def meta_info(self, speculative: bool) -> dict:
        info = {"id": self.rid, "prompt_tokens": len(self.prompt_ids),
                "completion_tokens": len(self.output_ids), "finish_reason": self.finish_reason,
                "cached_tokens": self.cached_tokens or 0}
        if self.finished_time is not None:
            # seconds from generate() to the finish (sglang: e2e_latency) and to the first
            # token; output_throughput = completion tokens per second of e2e_latency
            e2e = self.finished_time - self.created_time
            info["e2e_latency"] = e2e
            if self.first_token_time is not None:
                info["ttft"] = self.first_token_time - self.created_time
            info["output_throughput"] = len(self.output_ids) / e2e if e2e > 0 else 0.0
        if self.return_logprob:
            info["output_token_logprobs"] = list(self.output_logprobs)
            if self.top_logprobs_num:
                info["output_top_logprobs"] = list(self.output_top_logprobs)
            if self.logprob_start_len >= 0:
                info["input_token_logprobs"] = list(self.prompt_logprobs)
                info["input_top_logprobs"] = list(self.prompt_top_logprobs)
        if speculative:
            committed = sum(n * (i + 1) for i, n in enumerate(self.spec_accept_histogram))
            info["spec_verify_ct"] = self.spec_verify_ct
            info["spec_accept_length"] = committed / self.spec_verify_ct if self.spec_verify_ct else 0.0
            info["spec_accept_histogram"] = list(self.spec_accept_histogram)
            info["spec_width_histogram"] = list(self.spec_width_histogram)
        return info
