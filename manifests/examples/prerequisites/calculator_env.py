"""A calculator tool for GSM8K-style questions (manifests/examples/tool-use-grpo-job.yaml).

Each turn the model either calls the tool, <calc>12 * (3 + 4)</calc>, and the environment answers with
<result>84</result> in a user turn of the Qwen chat template; or it answers, "#### 84", which ends the
episode with reward 1 when the number equals the label's (GSM8K's answers end with "#### <number>").
A turn with neither is told the format. The job mounts it from the ConfigMap tool-use-calculator, which
kustomization.yaml beside it makes; an image of your own may carry it instead, or serve it over HTTP.
"""

import ast
import operator
import re

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
TURN = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.Pow: operator.pow, ast.USub: operator.neg, ast.Mod: operator.mod}


def evaluate(expression: str) -> float:
    """Arithmetic only: numbers and + - * / ** %, parenthesised; nothing else is evaluated."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            right = value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return OPERATORS[type(node.op)](value(node.left), right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / ** % are allowed")
    return value(ast.parse(expression, mode="eval").body)


def number(text: str) -> float | None:
    match = ANSWER.search(text)
    return float(match.group(1).replace(",", "")) if match else None


class Calculator:
    def reset(self, prompt: str, label: str) -> None:
        self.expected = number(label)

    def step(self, completion: str) -> tuple[str, float, bool]:
        answer = number(completion)
        if answer is not None:
            return "", float(self.expected is not None and abs(answer - self.expected) < 1e-6), True
        call = CALL.search(completion)
        if call is None:
            return TURN.format("Use <calc>expression</calc> or answer with #### <number>."), 0.0, False
        try:
            result = f"<result>{evaluate(call.group(1)):g}</result>"
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as error:
            result = f"<error>{error}</error>"
        return TURN.format(result), 0.0, False
