"""ToRA's ``math_equal`` as verl's PRIME math scorer runs it (``rlcore.task.verl_scores.prime_math``):
string, numeric (relative tolerance 1e-4, with x/100 and x*100 accepted), interval, tuple, point
and matrix comparisons.

Ported from verl 1dda039, verl/utils/reward_score/prime_math/grader.py:109-386 (Apache-2.0; from
microsoft/ToRA, ProphetNet/CRITIC and openai/prm800k, MIT), with two deliberate differences:

- verl evaluates model output with Python's ``eval`` (grader.py:168-170 after replacing ``\\pi``,
  grader.py:290-292 for a bracketed matrix answer) and parses ``Matrix(...)`` answers with sympy's
  ``parse_expr`` (which evaluates too). Here ``safe_eval`` evaluates literals and arithmetic only,
  and a ``Matrix(...)`` answer is parsed only when it names nothing but sympy's functions and
  one-letter symbols; anything else is what verl does when ``eval`` raises.
- ``symbolic_equal`` (grader.py:324-359) never returns True in verl at this commit: it enters
  ``with timeout_limit(seconds=timeout):``, but ``timeout_limit`` is a decorator factory
  (verl/utils/py_functional.py:56), so each ``with`` raises TypeError, which its ``except
  Exception`` clauses swallow: no parse, no simplify, no numeric check. It is ported as that
  outcome (False), which the parity fixture confirms against verl's own code.
"""

from __future__ import annotations

import ast
import contextlib
import math
import operator
import re
from math import isclose


def is_digit(s):
    try:
        if "{,}" in str(s):
            num = float(str(s).replace("{,}", ""))
            return True, num

        num = float(str(s).replace(",", ""))
        return True, num
    except ValueError:
        return False, None


def normalize(answer, pi) -> str:
    # checking if answer is $<number> and removing $ in that case to compare
    if isinstance(answer, str) and bool(re.match(r"\$\d+(\.\d+)?", answer)):
        return answer[1:]

    # checking if answer is <number>% or <number>\\% and removing %
    if isinstance(answer, str) and (
        bool(re.match(r"^\d+(\.\d+)?%$", answer)) or bool(re.match(r"^\d+(\.\d+)?\\%$", answer))
    ):
        return answer.replace("\\%", "").replace("%", "")

    # handle base
    answer = handle_base(answer)

    # handle pi
    answer = handle_pi(answer, pi)

    return answer


def handle_base(x) -> str:
    if isinstance(x, str) and "_" in x:
        # Due to base
        x = x.split("_")[0]
        x = float(x)
        return int(x)
    return x


def handle_pi(string, pi):
    if isinstance(string, str) and "\\pi" in string:
        # Find the first occurrence of "\pi"
        idx = string.find("\\pi")

        # Iterate over the string and find all occurrences of "\pi" with a valid previous character
        while idx != -1:
            if idx > 0 and string[idx - 1].isdigit():
                # Replace "\pi" with "*math.pi" if the previous character is a digit
                string = string[:idx] + f"*{pi}" + string[idx + 3 :]
            else:
                # Replace "\pi" with "1*math.pi" if the previous character is not a digit
                string = string[:idx] + f"1*{pi}" + string[idx + 3 :]

            # Find the next occurrence of "\pi"
            idx = string.find("\\pi", idx + 1)

        # verl evaluates the expression with Python's eval (grader.py:168-170): arithmetic only here
        with contextlib.suppress(Exception):
            string = safe_eval(string)

    return string


def math_equal(
    prediction: bool | float | str,
    reference: float | str,
    include_percentage: bool = True,
    tolerance: float = 1e-4,
    timeout: float = 10.0,
    pi: float = math.pi,
) -> bool:
    """
    Exact match of math if and only if:
    1. numerical equal: both can convert to float and are equal
    2. symbolic equal: both can convert to sympy expression and are equal
    """

    prediction = normalize(prediction, pi)
    reference = normalize(reference, pi)

    if isinstance(prediction, str) and len(prediction) > 1000:  # handling weird corner-cases
        prediction = prediction[:1000]

    # 0. string comparison
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True

    try:  # 1. numerical equal
        if is_digit(prediction)[0] and is_digit(reference)[0]:
            prediction = is_digit(prediction)[1]
            reference = is_digit(reference)[1]
            # number questions
            gt_result = [reference / 100, reference, reference * 100] if include_percentage else [reference]
            for item in gt_result:
                try:
                    if isclose(item, prediction, rel_tol=tolerance):
                        return True
                except Exception:
                    continue
            return False
    except Exception:
        pass

    if not prediction and prediction not in [0, False]:
        return False

    # 2. symbolic equal
    reference = str(reference).strip()
    prediction = str(prediction).strip()

    ## deal with [], (), {}
    prediction = format_intervals(prediction)

    pred_str, ref_str = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
        prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")
    ):
        pred_str = pred_str.strip("[]()")
        ref_str = ref_str.strip("[]()")
    for s in ["{", "}", "(", ")"]:
        ref_str = ref_str.replace(s, "")
        pred_str = pred_str.replace(s, "")
    if pred_str == ref_str:
        return True

    ## [a, b] vs. [c, d], return a==c and b==d
    if (
        prediction
        and reference
        and prediction[0] in "(["
        and prediction[-1] in ")]"
        and prediction[0] == reference[0]
        and prediction[-1] == reference[-1]
    ):
        pred_parts = prediction[1:-1].split(",")
        ref_parts = reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and _all_equal(pred_parts, ref_parts, include_percentage, tolerance):
            return True

    if "," in prediction and "," in reference:
        pred_parts = [item.strip() for item in prediction.split(",")]
        ref_parts = [item.strip() for item in reference.split(",")]

        if len(pred_parts) == len(ref_parts):
            return bool(
                all(
                    [
                        math_equal(pred_parts[i], ref_parts[i], include_percentage, tolerance)
                        for i in range(len(pred_parts))
                    ]
                )
            )

    # if we have point == tuple of values
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        pred_parts = prediction[prediction.find("(") + 1 : -1].split(",")
        ref_parts = reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and _all_equal(pred_parts, ref_parts, include_percentage, tolerance):
            return True

    # if reference is a matrix
    if r"\begin{pmatrix}" in reference and prediction.startswith("Matrix"):
        try:
            pred_matrix = _parse_matrix(prediction)
            ref_matrix_items = reference.split()[1:-1:2]
            if len(pred_matrix) == len(ref_matrix_items) and _all_equal(pred_matrix, ref_matrix_items,
                                                                          include_percentage, tolerance):
                return True
        except Exception:
            pass
    elif r"\begin{pmatrix}" in reference and prediction.startswith("[") and prediction.endswith("]"):
        if isinstance(safe_eval(prediction), list):  # verl: Python's eval (grader.py:290-292)
            try:
                pred_matrix = safe_eval(prediction)
                # ref_matrix_items = reference.split()[1:-1:2]
                ref_matrix_items = (
                    reference.removeprefix(r"\\begin{pmatrix}")
                    .removeprefix(r"\begin{pmatrix}")
                    .removesuffix(r"\\end{pmatrix}")
                    .removesuffix(r"\end{pmatrix}")
                )
                ref_matrix_items = ref_matrix_items.split("\\")
                ref_matrix_items = [row.split("&") if "&" in row else row for row in ref_matrix_items]
                if len(pred_matrix) == len(ref_matrix_items) and _all_equal(pred_matrix, ref_matrix_items,
                                                                              include_percentage, tolerance):
                    return True
            except Exception:
                pass

    return symbolic_equal(prediction, reference, tolerance, timeout)

def _all_equal(preds, refs, include_percentage, tolerance) -> bool:
    """verl's ``all([math_equal(p, r, ...) for ...])``: every pair compared (no short cut), as there."""
    return all([math_equal(p, r, include_percentage, tolerance) for p, r in zip(preds, refs)])


def symbolic_equal(a, b, tolerance, timeout=10.0) -> bool:
    """Always False, as verl's at 1dda039 (see the module docstring)."""
    return False


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 10_000  # beyond it a power is refused: eval would compute 9**9**9 for ever


def safe_eval(text: str):
    """What ``eval(text)`` gives for literals (numbers, strings, lists, tuples) combined by + - * / //
    % ** and unary signs; ValueError for anything else (names, calls, attributes), as eval raises
    for an unknown name."""
    return _evaluate(ast.parse(text.strip(), mode="eval").body)


def _evaluate(node):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_evaluate(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(right, (int, float)) and abs(right) > _MAX_EXPONENT:
            raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"not evaluated: {type(node).__name__}")


_MATRIX_NAMES = {"Matrix", "sqrt", "pi", "E", "I", "exp", "log", "sin", "cos", "tan", "Rational"}


def _parse_matrix(text: str):
    """sympy's ``parse_expr`` of a ``Matrix(...)`` answer that names only sympy functions and
    one-letter symbols; ValueError otherwise (verl's ``except Exception`` then passes)."""
    names = set(re.findall(r"[A-Za-z_]\w*", text))
    if "__" in text or any(len(n) > 1 and n not in _MATRIX_NAMES for n in names) or re.search(r"[\"'`;]", text):
        raise ValueError("not a plain Matrix(...) expression")
    from sympy.parsing.sympy_parser import parse_expr

    return parse_expr(text)


def format_intervals(prediction):
    patterns = {
        "Interval(": r"^Interval\((.*)\)$",
        "Interval.Ropen(": r"^Interval\.Ropen\((.*)\)$",
        "Interval.Lopen(": r"^Interval\.Lopen\((.*)\)$",
        "Interval.open(": r"^Interval\.open\((.*)\)$",
    }

    for key, pattern in patterns.items():
        match = re.match(pattern, prediction)
        if match:
            inner_content = match.group(1)

            if key == "Interval(":  # Intarval(a, b) == [a, b]
                return f"[{inner_content}]"
            elif key == "Interval.Ropen(":  # Intarval.Ropen(a, b) == [a, b)
                return f"[{inner_content})"
            elif key == "Interval.Lopen(":  # Intarval.Lopen(a, b) == (a, b]
                return f"({inner_content}]"
            elif key == "Interval.open(":  # Intarval.open(a, b) == (a, b)
                return f"({inner_content})"

    return prediction
