"""Rule rewards on hand-written cases: right, wrong, malformed, unicode."""
import pytest

from reward_service import rules


@pytest.mark.parametrize("text, answer", [
    ("so the total is 12 apples.\n#### 42", "42"),
    ("First 3, then 4, so \\boxed{7}", "7"),
    ("\\boxed{\\frac{1}{2}} is it", "\\frac{1}{2}"),
    ("nested \\boxed{{1}+{2}}", "{1}+{2}"),
    ("we get 3 then 5 and finally 1,234.", "1,234"),
    ("the answer is −5", "-5"),  # unicode minus
    ("答案是 ４２", "42"),  # fullwidth digits
    ("no number here", None),
    ("", None),
])
def test_extract_answer(text, answer):
    assert rules.extract_answer(text) == answer


@pytest.mark.parametrize("text, value", [
    ("42", 42.0), ("-3.5", -3.5), ("1,234", 1234.0), ("\\frac{1}{2}", 0.5), ("3/4", 0.75),
    ("50%", 0.5), ("$12", 12.0), ("7.", 7.0), ("1e3", 1000.0), ("abc", None), ("1/0", None), ("", None),
])
def test_parse_number(text, value):
    assert rules.parse_number(text) == value


@pytest.mark.parametrize("response, reference, score", [
    ("#### 42", "42", 1.0),
    ("Let me think. 6*7 = 42", 42, 1.0),
    ("\\boxed{42.0}", "#### 42", 1.0),  # reference in GSM8K form, response boxed
    ("#### 41", "42", 0.0),  # wrong
    ("I don't know", "42", 0.0),  # malformed: no answer at all
    ("#### forty-two", "42", 0.0),  # malformed answer after ####
    ("#### −7", "-7", 1.0),  # unicode minus
    ("٤٢", "42", 1.0),  # Arabic-Indic digits are digits
    ("0.30000000000000004", "0.3", 1.0),  # tolerance
    ("#### 1/3", "0.3333333333", 1.0),
    ("#### 42", None, None),  # no reference: cannot judge
    ("#### 42", "n/a", None),
])
def test_math_answer(response, reference, score):
    assert rules.math_answer(response, reference) == score


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
