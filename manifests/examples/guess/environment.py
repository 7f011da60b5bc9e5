"""The guessing game of the multi-turn CPU example: the environment thinks of a letter (a, b, c or d,
the record's label) and answers each guess with "higher" or "lower" (in the alphabet) until the policy
names it or runs out of turns.

A guess is the first non-space character of the policy's turn; anything else than a-d is answered with
the rules. The reward is 1 for the right letter, so the episode reward is 1 when the policy wins and 0
when it does not; an optimal player, bisecting with the answers, always wins within 3 turns.
"""

LETTERS = "abcd"
# Observations continue the chat: the policy's turn ended with <|im_end|>; the user answers and the
# assistant's next turn begins (the tiny model's ChatML-style template, manifests/examples/tiny).
TURN = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def guess_of(completion: str) -> str | None:
    text = completion.strip()
    return text[0] if text and text[0] in LETTERS else None


class GuessTheLetter:
    def reset(self, prompt: str, label: str) -> None:
        self.secret = label

    def step(self, completion: str) -> tuple[str, float, bool]:
        guess = guess_of(completion)
        if guess is None:
            return TURN.format("a, b, c or d?"), 0.0, False
        if guess == self.secret:
            return "", 1.0, True
        return TURN.format("higher" if guess < self.secret else "lower"), 0.0, False
