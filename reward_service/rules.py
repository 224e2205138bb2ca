"""Rule and verifiable rewards: pure functions of text, one score per response.

Each returns a float, or None when the sample cannot be judged (e.g. no reference answer), which
the service counts as invalid rather than guessing.
"""
from __future__ import annotations

import math
import re
import unicodedata

# Unicode minus signs and dashes people (and models) write before numbers.
_MINUS = dict.fromkeys(map(ord, "\u2212\u2012\u2013\u2014\ufe63\uff0d"), "-")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_HASHES = re.compile(r"####\s*(.+)")


def _normalise(text: str) -> str:
    return unicodedata.normalize("NFKC", text).translate(_MINUS)  # NFKC: fullwidth digits -> ASCII


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response: after `####`, else in the last \\boxed{}, else the last number."""
    text = _normalise(text)
    m = _HASHES.findall(text)
    if m:
        return m[-1].strip()
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str) -> float | None:
    """A number from an answer string: '1,234', '-3.5', '\\frac{1}{2}', '50%' ('5e3' too); else None."""
    text = _normalise(text).strip().rstrip(".").replace("$", "").replace(" ", "")
    frac = re.fullmatch(r"\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", text)
    if frac:
        num, den = float(frac[1]), float(frac[2])
        return num / den if den else None
    if re.fullmatch(r"-?\d+/\d+", text):
        num, den = text.split("/")
        return int(num) / int(den) if int(den) else None
    percent = text.endswith("%")
    text = text.rstrip("%")
    if not _NUMBER.fullmatch(text):
        return None
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return value / 100 if percent else value


def math_answer(response: str, reference: str | float | int | None, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float | None:
    """1.0 if the response's final answer equals the reference numerically (within tolerance), else
    0.0; a malformed or missing answer is 0.0. None when there is no usable reference."""
    if reference is None:
        return None
    ref = float(reference) if isinstance(reference, (int, float)) else parse_number(extract_answer(str(reference)) or "")
    if ref is None or not math.isfinite(ref):
        return None
    answer = extract_answer(response)
    value = parse_number(answer) if answer is not None else None
    if value is None:
        return 0.0
    return 1.0 if math.isclose(value, ref, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


def exact_match(response: str, reference: str | None) -> float | None:
    """1.0 if the response equals the reference up to surrounding and repeated whitespace."""
    if reference is None:
        return None
    norm = lambda s: " ".join(_normalise(str(s)).split())  # noqa: E731
    return 1.0 if norm(response) == norm(reference) else 0.0


def format_reward(response: str, pattern: str) -> float:
    """1.0 if the regular expression matches anywhere in the response (DOTALL), else 0.0."""
    return 1.0 if re.search(pattern, response, flags=re.DOTALL) else 0.0


def length_penalty(response: str, target_length: int) -> float:
    """-|characters - target| / target: 0 at the target, -1 at twice (or zero times) the target."""
    return -abs(len(response) - target_length) / target_length
