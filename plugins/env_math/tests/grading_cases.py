"""The graded cases of test_grading_table.py: (id, response, gold, expected reward, expected status).

Rewards are with correct_reward=1, format_reward=0. Statuses: see rlcore_math.grading.STATUSES.
"""

from __future__ import annotations

MB = 1_000_000

CORRECT = [
    ("gsm8k_hash", "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72", "72"),
    ("hash_commas", "The total is 1000.\n#### 1,000", "1000"),
    ("hash_dollar", "She earns $18 every day.\n#### $18", "18"),
    ("hash_decimal", "Each costs 3.5 dollars.\n#### 3.5", "3.5"),
    ("boxed_int", "Adding them gives \\boxed{42}.", "42"),
    ("answer_is", "Counting the apples, the answer is 17.", "17"),
    ("final_number", "First 3+4=7, then 7*2=14", "14"),
    ("arith_demo", "19", "19"),
    ("int_gold", "#### 72", 72),
    ("boxed_frac", "So $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("decimal_vs_frac", "\\boxed{0.5}", "\\frac{1}{2}"),
    ("frac_vs_decimal", "\\boxed{\\frac{3}{4}}", "0.75"),
    ("dfrac", "\\boxed{\\dfrac{5}{6}}", "\\frac{5}{6}"),
    ("percent", "\\boxed{25\\%}", "25\\%"),
    ("percent_text", "The answer is 25%", "25"),
    ("negative", "\\boxed{-3}", "-3"),
    ("sqrt_forms", "\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}"),
    ("sqrt_shorthand", "\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt 3}{2}"),
    ("interval", "\\boxed{(1, 2]}", "(1,2]"),
    ("interval_inf", "\\boxed{[0, \\infty)}", "[0,\\infty)"),
    ("set_order", "\\boxed{\\{1, 2, 3\\}}", "\\{3,2,1\\}"),
    ("expanded_expr", "\\boxed{(x+1)^2}", "x^2+2x+1"),
    ("pi", "\\boxed{2\\pi}", "2\\pi"),
    ("inline_latex", "So the answer is $\\frac{7}{3}$.", "\\frac{7}{3}"),
    ("trailing_zero", "\\boxed{1.50}", "1.5"),
    ("assignment", "\\boxed{x = 5}", "5"),
    ("power_of_ten", "\\boxed{10^{3}}", "1000"),
    ("tuple", "\\boxed{(1, 2)}", "(1,2)"),
    ("text_units", "\\boxed{12 \\text{ cm}}", "12"),
    ("last_boxed_wins", "Maybe \\boxed{3}? No: \\boxed{5}", "5"),
    ("unicode_prose", "答案是 5", "5"),
    ("control_chars", "\x00\x07 \\boxed{5}", "5"),
    ("long_prose_then_boxed", "word " * 18_000 + "\\boxed{5}", "5"),
]

INCORRECT = [
    ("hash_off_by_one", "#### 71", "72"),
    ("wrong_frac", "\\boxed{\\frac{1}{3}}", "\\frac{1}{2}"),
    ("open_vs_closed_interval", "\\boxed{(1,2)}", "(1,2]"),
    ("subset", "\\boxed{\\{1,2\\}}", "\\{1,2,3\\}"),
    ("wrong_expr", "\\boxed{x^2+1}", "(x+1)^2"),
    ("sign", "The answer is 5", "-5"),
    ("close_decimal", "\\boxed{0.51}", "\\frac12"),
    ("last_number_counts", "I think 3, then 4", "3"),
    ("pi_factor", "\\boxed{2\\pi}", "\\pi"),
    ("wrong_sqrt", "\\boxed{\\sqrt{3}}", "\\sqrt{2}"),
    ("wrong_large", "\\boxed{1000}", "1001"),
    ("letters_vs_number", "\\boxed{abc}", "5"),
    ("hash_beats_earlier_number", "5 apples\n#### 6", "5"),
]

MALFORMED = [
    ("empty", "", "5", "parse_error"),
    ("no_answer", "I don't know.", "5", "parse_error"),
    ("unclosed_boxed", "\\boxed{5", "5", "parse_error"),
    ("empty_boxed", "\\boxed{}", "5", "parse_error"),
    ("only_dollars", "$$$$", "5", "parse_error"),
    ("not_text", None, "5", "error"),
    ("not_text_bytes", b"\\boxed{5}", "5", "error"),
    ("empty_gold", "\\boxed{5}", "", "gold_error"),
    ("none_gold", "\\boxed{5}", None, "gold_error"),
    ("closers_only", "}}}}]]]))))", "5", "parse_error"),
]

ADVERSARIAL = [
    ("one_mb_digits", "1" * MB, "1", "rejected"),
    ("one_mb_then_boxed", "a" * MB + "\\boxed{5}", "5", "rejected"),
    ("deep_frac", "\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}", "1", "rejected"),
    ("deep_braces_100k", "{" * 100_000, "1", "rejected"),
    ("many_unclosed_boxed", "\\boxed{1 " * 500, "1", "rejected"),
    ("deep_parens_unclosed", "The answer is " + "(" * 5000, "1", "rejected"),
    ("moderately_deep_sqrt", "\\boxed{" + "\\sqrt{" * 30 + "2" + "}" * 30 + "}", "2", "rejected"),
    ("tower_9_9_9", "\\boxed{9^{9^{9}}}", "1", "timeout"),
    ("tower_10_10_10", "\\boxed{10^{10^{10}}}", "1", "timeout"),
    ("factorial_million", "\\boxed{1000000!}", "1", "timeout"),
    ("two_to_million", "\\boxed{2^{1000000}}", "1", "ok"),
    ("huge_literal", "\\boxed{" + "9" * 3000 + "}", "1", "ok"),
    ("huge_symbolic_power", "\\boxed{x^{99999999}}", "x", "ok"),
    ("hash_regex_bomb", "#### " + "1," * 20_000, "1", "ok"),
]


def all_cases() -> list[tuple[str, object, object, float, str]]:
    cases = [(i, r, g, 1.0, "ok") for i, r, g in CORRECT]
    cases += [(i, r, g, 0.0, "ok") for i, r, g in INCORRECT]
    cases += [(i, r, g, 0.0, s) for i, r, g, s in MALFORMED + ADVERSARIAL]
    return cases
