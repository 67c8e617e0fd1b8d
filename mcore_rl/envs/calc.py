"""The `calc` tool: exact arithmetic on a model-written expression, parsed with `ast` and walked by hand.

Why not eval: the expression is untrusted text. Only number literals, + - * / // % ** and unary signs are
accepted; names, calls, attributes and everything else are refused with a one-line error the model sees. Sizes are
bounded before computing (exponents, digit counts), so `9**9**9` is an error here, not a hung worker (the pool's
deadline and memory limit stay as the second line of defence).
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

MAX_EXPR_CHARS = 200
MAX_DIGITS = 60  # operands and results beyond this are refused
MAX_EXPONENT = 64

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """An expression the tool refuses; its message is what the model reads."""


def _digits(x: Fraction) -> int:
    return max(len(str(abs(x.numerator))), len(str(x.denominator)))


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise CalcError(f"exponents must be whole numbers with |n| <= {MAX_EXPONENT}")
            if _digits(left) * abs(int(right)) > 4 * MAX_DIGITS:
                raise CalcError("result too large")
            if left == 0 and right < 0:
                raise CalcError("division by zero")
            return left ** int(right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalcError("division by zero")
        result = _BINOPS[type(node.op)](left, right)
        return Fraction(result)
    raise CalcError(
        f"unsupported syntax: {type(node).__name__} (use numbers, + - * / // % ** and parentheses)"
    )


def format_number(x: Fraction) -> str:
    """Integers exactly; other values as exact decimals when short, else to 10 significant digits."""
    if x.denominator == 1:
        return str(x.numerator)
    text = f"{float(x):.10g}"
    return text


def evaluate(expression: str) -> str:
    """The `calc` tool (runs in a sandboxed worker): the value as text; CalcError (a ValueError, one line the
    model reads as `Error: ...`) for anything refused."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalcError("expression must be a non-empty string")
    if len(expression) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    text = expression.replace(",", "").replace("^", "**").replace("×", "*").replace("÷", "/").strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {expression.strip()!r}") from None
    result = _eval(tree)
    if _digits(result) > MAX_DIGITS:
        raise CalcError("result too large")
    return format_number(result)
