"""Two-turn records whose second user turn follows up on the first: a training prompt of another source, its known
answer as the assistant turn (the documentation's sentences, the computed result, the corrected call; regenerate
rewrites it with the target's own answer before the follow-up is answered), then a question about that answer.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from dflash_lightning.regenerate.prompts.python_docs import MIN_ANSWER_CHARS, MORE_TEMPLATES
from dflash_lightning.regenerate.prompts.records import Prompt

CATEGORY = "follow_ups"
GENERAL = ("Can you explain that in simpler terms?", "Summarize that in one sentence.", "Why is that?",
           "Can you give me an example?", "Are you sure? Please double-check.", "What is a common mistake here?",
           "Explain it as if I were ten years old.", "Can you put that in a table?", "Thanks! One more question: "
           "how would I check that myself?", "Could you make that shorter?") + MORE_TEMPLATES
BY_SOURCE: dict[str, tuple[str, ...]] = {
    "python_docs": ("Show me a code example of that.", "How is this different in other languages?",
                    "What happens if I get this wrong?", "Where is this used in the standard library?",
                    "Can you write a small program that uses this?"),
    "library_api": ("Show me another example.", "What other arguments does it take?", "What exceptions can it raise?",
                    "Is there a faster alternative?", "How would I test code that uses it?",
                    "Can you show the same thing without this function?"),
    "arithmetic": ("Can you show the steps?", "Now multiply the result by {k}.", "Now add {k} to that.",
                   "Check that answer another way.", "How would I do this in my head?",
                   "Write a Python expression that computes it.", "What is that divided by {k}?"),
    "word_problems": ("Explain how you set up the problem.", "What if the numbers were doubled?",
                      "Write this as an equation.", "Can you check the answer by working backwards?",
                      "Make up a similar problem for me to practice.", "Write Python code that solves it."),
}


def prompts(rng: random.Random, firsts: Sequence[Prompt]) -> Iterator[Prompt]:
    """Endless follow-ups on `firsts` (one-turn records with a reference answer of at least a sentence)."""
    firsts = [p for p in firsts if p.reference and len(p.reference) >= MIN_ANSWER_CHARS or
              p.reference and p.category in ("arithmetic", "word_problems")]
    if not firsts:
        return
    for n in range(10**9):
        first = rng.choice(firsts)
        ask = rng.choice(GENERAL + BY_SOURCE.get(first.category, ())).format(k=rng.randint(2, 12))
        messages = [*first.messages, {"role": "assistant", "content": first.reference},
                    {"role": "user", "content": ask}]
        yield Prompt(f"{CATEGORY}:{n}:{first.id}", CATEGORY, messages)
