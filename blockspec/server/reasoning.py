"""Reasoning in generated text (``--reasoning-parser``): what a thinking model writes between
``<think>`` and ``</think>`` goes to ``reasoning_content``, the rest to ``content``.

Nemotron 3's chat template opens ``<think>`` at the end of the generation prompt when thinking
is on, so the output starts inside the reasoning with no opening tag. The rule here: the
output starts as reasoning when the rendered prompt ends with ``<think>`` (whitespace aside)
and ``enable_thinking`` is not false; otherwise it starts as content, and a ``<think>`` at the
very start of the output (whitespace aside) opens the reasoning. Either way the first
``</think>`` ends it; an output that ends inside it (a length cut) is all reasoning. The parser
is incremental: a tag split across chunks (``</th`` + ``ink>``) is held back, never shown."""
from __future__ import annotations

__all__ = ["REASONING_PARSERS", "ReasoningParser", "opens_reasoning"]

THINK, UNTHINK = "<think>", "</think>"


def opens_reasoning(prompt: str) -> bool:
    """The rendered prompt leaves the model inside an open ``<think>``."""
    return prompt.rstrip().endswith(THINK)


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """``feed(text)`` / ``finish()`` -> (reasoning, content) pieces of one output."""

    def __init__(self, in_reasoning: bool, may_open: bool = True) -> None:
        self._state = "reasoning" if in_reasoning else ("start" if may_open else "content")
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        if self._state == "start":
            lead = self._buf.lstrip()
            if lead.startswith(THINK):
                self._buf, self._state = lead[len(THINK):], "reasoning"
            elif THINK.startswith(lead):
                return "", ""                # could still become <think>
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buf.find(UNTHINK)
            if end < 0:
                keep = _held(self._buf, UNTHINK)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            reasoning, self._buf = self._buf[:end], self._buf[end + len(UNTHINK):]
            self._state = "content"
        if self._state == "content":
            content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Held text: a partial ``</think>`` is reasoning, a partial ``<think>`` content."""
        rest, self._buf = self._buf, ""
        return (rest, "") if self._state == "reasoning" else ("", rest)


REASONING_PARSERS = ("nemotron_3",)
