"""Rule rewards on hand-written cases: right, wrong, malformed, unicode; math answers via math-verify."""

import pytest

from reward_service import rules


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so the total is 12 apples.\n#### 42", "42"),
        ("so the total is 12 apples.\n#### 42 \n\n", "42"),  # trailing blank lines: still the last line
        ("#### Step 2\nAdd them: \\boxed{7}", "7"),  # a markdown heading is no final-answer mark
        ("#### Step 2\nso we get 7.", None),  # nothing declared: math-verify reads the whole text
        ("First 3, then 4, so \\boxed{7}", "7"),
        ("\\boxed{3} or rather \\boxed{4}", "4"),  # the last boxed answer wins
        ("\\boxed{\\frac{1}{2}} is it", "\\frac{1}{2}"),
        ("\\boxed{{1}}", "1"),  # redundant braces go
        ("nested \\boxed{{1}+{2}}", "{1}+{2}"),  # these braces are not one group
        ("truncated \\boxed{4", None),
        ("#### −5", "-5"),  # unicode minus
        ("答案是 \\boxed{４２}", "42"),  # fullwidth digits
        ("we get 3 then 5 and finally 1,234.", None),
        ("", None),
    ],
)
def test_final_answer(text, answer):
    assert rules.final_answer(text) == answer


# (response, reference, expected): what a careful grader would give. References come as GSM8K
# solutions, LaTeX, \boxed{}, plain strings or numbers. math-verify's choices worth knowing:
# a percent equals both its fraction and its bare number (50% == 0.5 == 50); floats match to 6
# decimals (so 1/3 == 0.3333333333, but 4.67 != 14/3); `x = 5` equals 5; sets ignore order.
MATH_ROWS = [
    # plain integers (the arithmetic tasks' fast path) and GSM8K
    ("135", "135", 1.0),
    ("135\n", 135, 1.0),
    ("135.", "135", 1.0),
    ("136", "135", 0.0),
    ("Let me think. 6*7 = 42", 42, 1.0),
    ("56 is the answer", "56", 1.0),
    ("so the total is 12 apples.\n#### 42", "42", 1.0),
    ("#### 72", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", 1.0),  # GSM8K-form reference
    ("#### 24", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", 0.0),
    ("\\boxed{42.0}", "#### 42", 1.0),
    ("#### 41", "42", 0.0),
    # thousands separators, units, currency
    ("#### 1,234", "1234", 1.0),
    ("The answer is 1,234.", "1234", 1.0),
    ("\\boxed{1,234}", "1,234", 1.0),
    ("#### $12", "12", 1.0),
    ("It costs \\$12.", "12", 1.0),
    ("It costs \\$12 and \\$5 more", "5", 1.0),  # no answer mark: math-verify takes the last number
    ("#### 5 cm", "5", 1.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    # fractions and decimals
    ("\\boxed{\\frac{14}{3}}", "\\frac{14}{3}", 1.0),
    ("\\boxed{14/3}", "\\frac{14}{3}", 1.0),
    ("#### 4.666666666666667", "\\frac{14}{3}", 1.0),
    ("\\boxed{4.67}", "\\frac{14}{3}", 0.0),  # rounded to 2 places: not the exact answer
    ("\\boxed{\\dfrac{14}{3}}", "$\\frac{14}{3}$", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("#### 1/3", "0.3333333333", 1.0),
    ("The answer is 0.30000000000000004", "0.3", 1.0),
    ("#### 0.25", 0.25, 1.0),
    ("#### 1e3", "1000", 1.0),  # relay reads scientific notation itself: math-verify reads 1e3 as 1
    # percents
    ("50%", "0.5", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("#### 0.5", "50%", 1.0),
    ("#### 50", "0.5", 0.0),
    # \boxed{} nesting and several answers
    ("\\boxed{{1}}", "1", 1.0),
    ("\\boxed{{\\frac{1}{2}}}", "\\frac12", 1.0),
    ("First \\boxed{3}, no wait: \\boxed{4}", "4", 1.0),  # the last boxed answer wins
    ("First \\boxed{3}, no wait: \\boxed{4}", "3", 0.0),
    ("#### Step 2\nAdd them: \\boxed{7}", "7", 1.0),  # the heading does not outrank the boxed answer
    ("#### Step 2\nAdd them: \\boxed{7}", "2", 0.0),
    ("#### Step 2\nso we get 7.", "7", 1.0),
    ("Therefore the final answer is $\\boxed{\\frac{3}{4}}$.", "\\boxed{\\frac{3}{4}}", 1.0),  # MATH-style reference
    # negatives, unicode
    ("#### −7", "-7", 1.0),  # unicode minus
    ("\\boxed{-7}", "7", 0.0),
    ("The temperature drops to −3 degrees.", "-3", 1.0),
    ("٤٢", "42", 1.0),  # Arabic-Indic digits
    ("答案是 ４２", "42", 1.0),  # fullwidth digits
    # symbolic answers, sets, tuples
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
    ("\\boxed{\\pi}", "\\pi", 1.0),
    ("\\boxed{3.14}", "\\pi", 0.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("$x = 5$", "5", 1.0),
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),
    ("\\boxed{(1, 2)}", "(1, 2)", 1.0),
    ("\\boxed{1, 2}", "1, 2", 1.0),  # a list reference, not 1,2 read as a number
    ("\\boxed{1, 3}", "1, 2", 0.0),
    ("\\boxed{2}", "\\{1, 2\\}", 0.0),
    # no answer, malformed, truncated
    ("I don't know", "42", 0.0),
    ("", "42", 0.0),
    ("#### forty-two", "42", 0.0),
    ("\\boxed{}", "42", 0.0),
    ("the answer is \\boxed{42", "42", 0.0),  # truncated mid-answer: math-verify finds no answer; no credit
    ("\\boxed{9^{9^{9^{9}}}}", "5", 0.0),  # too big to evaluate: refused before SymPy would hang
    ("\\boxed{(\\frac{1}{2})^{10^{9}}}", "0", 0.0),  # its exact denominator has 3e8 digits: refused too
    # no usable reference: cannot judge
    ("#### 42", None, None),
    ("#### 42", "n/a", None),
    ("#### 42", "Paris", None),
    ("#### 42", float("nan"), None),
    ("#### 42", "", None),
    pytest.param(
        "So the answer is $\\frac{1}{2}$. Check: 1+1=2",
        "\\frac{1}{2}",
        1.0,
        marks=pytest.mark.xfail(
            strict=True,
            reason="math-verify: its `answer ... = number` rule reaches past the stated answer to the later 1+1=2",
        ),
    ),
]


@pytest.mark.parametrize("response, reference, score", MATH_ROWS)
def test_math_answer(response, reference, score):
    assert rules.math_answer(response, reference) == score


def test_math_answer_plain_integers_take_the_fast_path(monkeypatch):
    import math_verify

    def fail(*args, **kwargs):
        raise AssertionError("math-verify called on plain integers")

    monkeypatch.setattr(math_verify, "parse", fail)
    monkeypatch.setattr(math_verify, "verify", fail)
    assert [
        rules.math_answer(r, ref)
        for r, ref in [("135", "135"), (" 46\n", 46), ("#### 72", "... #### 72"), ("\\boxed{7}", "8"), ("-3", "-3")]
    ] == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_math_answer_works_off_the_main_thread():
    # relay scores on helper threads (combine.call_with_deadline); a signal-based timeout would raise there
    from reward_service.combine import call_with_deadline

    got = call_with_deadline(
        lambda: [rules.math_answer("\\boxed{\\frac{2}{4}}", "0.5"), rules.math_answer("so 3 + 4 = 7", "7.0")], 60.0
    )
    assert got == [1.0, 1.0]


def test_exact_match_format_and_length():
    assert rules.exact_match("  Paris \n", "Paris") == 1.0
    assert rules.exact_match("paris", "Paris") == 0.0
    assert rules.exact_match("a  b", "a b") == 1.0
    assert rules.exact_match("x", None) is None
    assert rules.format_reward("<think>hm\nok</think> 4", r"<think>.*</think>") == 1.0
    assert rules.format_reward("<think>unclosed", r"<think>.*</think>") == 0.0
    assert rules.length_penalty("abcd", 4) == 0.0
    assert rules.length_penalty("ab", 4) == -0.5
    assert rules.length_penalty("abcdefgh", 4) == -1.0
