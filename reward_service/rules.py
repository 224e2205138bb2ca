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
_INT = re.compile(r"[-+]?\d{1,1000}")  # longer: beyond int() (and no answer)
# `#### 42` on the last non-empty line: GSM8K's final-answer mark (a `#### Step 2` heading earlier is not one).
_FINAL_HASHES = re.compile(r"####(?!.*####)[ \t]*([^\n]*?)\s*$")
# A snippet needs LaTeX parsing when it has LaTeX syntax or a list comma (not a thousands separator).
_LATEXY = re.compile(r"[\\^{}()\[\]]|,(?!\d{3}(?!\d))")
_SCIENTIFIC = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d{1,3}")
_MAX_DIGITS = 50_000  # a power or factorial this big is no answer; evaluating it holds the GIL for minutes


def _normalise(text: str) -> str:
    return unicodedata.normalize("NFKC", text).translate(_MINUS)  # NFKC: fullwidth digits -> ASCII


def _math_text(text: str) -> str:
    text = _normalise(text)
    if not text.isascii():  # other scripts' digits (Arabic-Indic ...) -> ASCII: math-verify reads only ASCII
        text = re.sub(r"\d", lambda m: str(unicodedata.digit(m[0])), text)
    return text


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced, redundant outer braces dropped (`{{1}}` -> `1`)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return _unbrace(text[i:j].strip())
    return None  # unclosed (a truncated response)


def _unbrace(s: str) -> str:
    while s.startswith("{") and s.endswith("}") and _closing(s) == len(s) - 1:
        s = s[1:-1].strip()
    return s


def _closing(s: str) -> int:
    """Index of the brace closing s[0]."""
    depth = 0
    for j, ch in enumerate(s):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return j
    return -1


def final_answer(text: str) -> str | None:
    """The answer a text declares: after a final `####` line, else in the last \\boxed{} (two boxed
    answers: the last wins); None when it declares none (math-verify then reads the whole text)."""
    return _declared(_math_text(text))


def _declared(text: str) -> str | None:
    m = _FINAL_HASHES.search(text)
    return m[1] if m else _boxed(text)


def _parse(snippet: str) -> list:
    """math-verify's parse of one answer: LaTeX (as if boxed) when it looks like LaTeX or a list,
    else plain text (numbers, 1,234, 50%, $12, 5 cm, 14/3). No signal timeout: relay's deadline applies."""
    from math_verify import parse

    s = snippet.replace("\\$", "").strip().strip("$").strip()
    if not s:
        return []
    if _SCIENTIFIC.fullmatch(s):  # math-verify reads 1e3 as 1
        import sympy

        return [sympy.Rational(s)]
    return parse(f"\\boxed{{{s}}}" if _LATEXY.search(s) else s, parsing_timeout=None)


def _tame(e) -> bool:
    """False if a SymPy expression holds a numeric power or factorial too big to evaluate: verify
    would compute it in C with the GIL held, beyond any thread deadline (e.g. 9^{9^{9^9}})."""
    import sympy

    if not isinstance(e, sympy.Basic):
        return True  # a string fallback, a matrix: nothing huge to evaluate
    if not all(_tame(a) for a in e.args):
        return False
    try:
        if isinstance(e, sympy.Pow) and e.is_number:
            exp = abs(complex(sympy.N(e.exp, 15)))
            return exp * math.log10(max(_height(e.base), 10)) <= _MAX_DIGITS
        if isinstance(e, sympy.factorial) and e.is_number:
            n = abs(complex(sympy.N(e.args[0], 15)))
            return n * math.log10(max(n, 2)) <= _MAX_DIGITS
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def _height(x) -> float:
    """How big the exact digits of a number get when raised to a power: max(|p|, |q|) of a rational
    (so (999/1000)^{10^9} counts), else the larger of |x| and 1/|x|."""
    import sympy

    if isinstance(x, sympy.Rational):
        return float(max(abs(x.p), abs(x.q)))
    v = abs(complex(sympy.N(x, 15)))
    return max(v, 1 / v) if v else 1.0


def _verify(gold: list, pred: list) -> float:
    from math_verify import verify

    if not pred or not all(_tame(p) for p in pred):
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


def _reference(reference) -> int | list | None:
    """The reference as a plain int (the fast path) or math-verify's parse of it; None if unusable.
    A string reference may be a GSM8K solution (`... #### 42`), LaTeX, `\\boxed{}`, 50%, 1,234 or text."""
    if reference is None or isinstance(reference, bool):
        return None
    if isinstance(reference, int):
        return reference
    if isinstance(reference, float):
        if not math.isfinite(reference):
            return None
        return int(reference) if reference.is_integer() else _parse(repr(reference))
    text = _math_text(str(reference))
    snippet = (_declared(text) or text).strip()
    if _INT.fullmatch(snippet):
        return int(snippet)
    gold = [g for g in _parse(snippet) if not isinstance(g, str)]  # a string alone is no math answer
    return gold if gold and all(_tame(g) for g in gold) else None


def math_answer(response: str, reference: str | float | int | None) -> float | None:
    """1.0 if the response's final answer equals the reference mathematically (Hugging Face's
    math-verify: parsing with latex2sympy, equality with SymPy), else 0.0; a malformed or missing
    answer is 0.0. None when there is no usable reference. Plain integers on both sides are
    compared directly (the hot path of the arithmetic tasks: no SymPy)."""
    gold = _reference(reference)
    if gold is None:
        return None
    text = _math_text(response)
    snippet = _declared(text)
    plain = (text if snippet is None else snippet).strip().rstrip(".").strip()
    if isinstance(gold, int) and _INT.fullmatch(plain):
        return 1.0 if int(plain) == gold else 0.0
    if isinstance(gold, int):
        import sympy

        gold = [sympy.Integer(gold)]
    if snippet is not None:
        return _verify(gold, _parse(snippet))
    from math_verify import parse

    return _verify(gold, parse(text.replace("\\$", ""), parsing_timeout=None))  # \$12: an escaped dollar sign


def answer_key(response: str, math: bool = True) -> str:
    """The answer a response gives, as maj@k votes on it. With `math`, its final answer read as
    math_answer reads it (the declared one, else math-verify's pick of the whole text), printed; without,
    or where it gives no mathematical answer, the response normalised (whitespace, trailing period)."""
    plain = " ".join(_normalise(response).split()).rstrip(".")
    if not math:
        return plain
    text = _math_text(response)
    snippet = _declared(text)
    s = (text if snippet is None else snippet).strip().rstrip(".").strip()
    if _INT.fullmatch(s):
        return str(int(s))
    if snippet is not None:
        parsed = _parse(snippet)
    else:
        from math_verify import parse

        parsed = parse(text.replace("\\$", ""), parsing_timeout=None)
    found = [p for p in parsed if not isinstance(p, str)]
    return str(found[0]) if found and all(_tame(p) for p in found) else plain


def same_answer(a: str, b: str) -> bool:
    """Whether two answers (answer_key's) are one mathematically: equal, else math-verify's equality with
    `a` taken as the reference (math_answer)."""
    return a == b or math_answer(b, a) == 1.0


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
