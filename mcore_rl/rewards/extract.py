"""Answer extraction and format checks: pure, linear-time string code.

Why our own extraction before math-verify: we only ever hand math-verify a short candidate (the \\boxed{}
content, the text after "the answer is", or the final number), never the whole response. That keeps parsing
cheap, makes `extracted` explainable in logs, and stops adversarial text from reaching sympy. Everything here
runs in O(len(text)) so it is safe on the untrusted tail of a response.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# "The answer is X", "Final answer: X", "answer = X" (case-insensitive; the last occurrence wins).
_ANSWER_PHRASE = re.compile(r"answer\s{0,8}(?:is|:|=)\s{0,8}:?", re.IGNORECASE)
# ASCII numbers only (\d would accept Arabic-Indic / full-width digits that sympy cannot parse).
_NUMBER = re.compile(r"-?[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?(?:\s?/\s?[0-9]+)?")
_FRAC = re.compile(r"-?\\[dt]?frac\{-?[0-9]+\}\{[0-9]+\}")
_BOX_CMDS = ("\\boxed{", "\\fbox{")
_STRIP_CHARS = " \t\r\n.$*`'\"“”"


@dataclass(frozen=True)
class Extraction:
    """A candidate answer and how it was found (`boxed` | `phrase` | `last_number`)."""

    candidate: str
    method: str


def tail(text: str, max_chars: int) -> str:
    """Keep the end of a long response: that is where the final answer is."""
    return text if len(text) <= max_chars else text[-max_chars:]


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...}, braces balanced; None if absent or unclosed."""
    start = max(text.rfind(cmd) for cmd in _BOX_CMDS)
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _answer_phrase(text: str) -> str | None:
    last = None
    for m in _ANSWER_PHRASE.finditer(text):
        last = m
    if last is None:
        return None
    rest = text[last.end() :]
    end = rest.find("\n")
    rest = rest if end < 0 else rest[:end]
    # A trailing sentence (". Because ...") is not part of the answer.
    dot = rest.find(". ")
    rest = rest if dot < 0 else rest[:dot]
    rest = rest.strip(_STRIP_CHARS)
    return rest or None


def _last_number(text: str) -> str | None:
    best: re.Match[str] | None = None
    for pattern in (_NUMBER, _FRAC):
        for m in pattern.finditer(text):
            if best is None or m.end() > best.end() or (m.end() == best.end() and m.start() < best.start()):
                best = m
    return None if best is None else best.group(0).replace(",", "")


def extract_answer(text: str) -> Extraction | None:
    """Priority: last \\boxed{} > last "answer is X" > last number (covers "3 + 4 = 7")."""
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return Extraction(boxed.strip(), "boxed")
    phrase = _answer_phrase(text)
    if phrase is not None:
        return Extraction(phrase, "phrase")
    number = _last_number(text)
    if number is not None:
        return Extraction(number, "last_number")
    return None


def max_brace_depth(text: str) -> int:
    """Deepest {}/()/[] nesting: deeply nested LaTeX makes sympy's parser recurse until it dies."""
    depth = best = 0
    for c in text:
        if c in "{([":
            depth += 1
            best = max(best, depth)
        elif c in "})]":
            depth = max(0, depth - 1)
    return best


def has_boxed_answer(text: str) -> bool:
    content = last_boxed(text)
    return content is not None and bool(content.strip())


def final_line_is_number(text: str) -> bool:
    """The last non-empty line ends with a digit ("7", "3 + 4 = 7", "The answer is 7.")."""
    stripped = text.rstrip()
    line = stripped[stripped.rfind("\n") + 1 :].rstrip(_STRIP_CHARS)
    return bool(line) and line[-1] in "0123456789"
