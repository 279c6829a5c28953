"""Generated programming tasks: "write a function that ...", classes, tests, SQL, shell, regular expressions and
"explain this code", in several languages and phrasings, filled from a seeded generator.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from dflash_lightning.regenerate.prompts.records import Prompt, user_prompt

CATEGORY = "code_tasks"
LANGUAGES = ("Python",) * 6 + ("JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "C#", "Ruby", "Kotlin")
THINGS = ("integers", "floats", "strings", "words", "dates", "file names", "email addresses", "prices", "scores",
          "temperatures", "user records", "tuples of (name, age)", "URLs", "timestamps", "product codes")
CONDITIONS = ("are even", "are negative", "start with a vowel", "are longer than {n} characters",
              "appear more than once", "are greater than the average", "are palindromes", "contain a digit",
              "are divisible by {n}", "are in uppercase", "fall on a weekend", "are within {n} of the maximum")
TASKS = (
    "returns the {n} largest {things} in a list", "counts how many {things} in a list {condition}",
    "removes the {things} that {condition} from a list", "groups a list of {things} by their first character",
    "checks whether a string is a valid {format}", "converts {unit_a} to {unit_b}",
    "merges two sorted lists of {things} into one sorted list", "splits a list of {things} into chunks of {n}",
    "finds the longest run of consecutive equal {things} in a list", "reverses the words in a sentence",
    "computes a running total over a list of {things}", "flattens a nested list of {things}",
    "parses a CSV line with quoted fields", "returns the n-th row of Pascal's triangle",
    "rotates a matrix by 90 degrees", "finds all pairs of {things} in a list whose sum is {n}",
    "compresses a string with run-length encoding", "validates a Sudoku board",
    "converts a Roman numeral to an integer", "formats a number of seconds as HH:MM:SS",
    "checks whether two strings are anagrams", "returns the most common {things} in a list",
    "computes the moving average of a list of {things} with a window of {n}", "deduplicates a list of {things}",
    "interleaves two lists of {things}", "finds the first {things} that {condition}",
    "sorts a list of {things} by two keys", "caches the results of an expensive function",
    "retries a failing network call up to {n} times", "reads a JSON file and returns the keys at the top level",
    "walks a directory tree and lists files larger than {n} MB", "counts word frequencies in a text file",
    "builds a histogram of {things} as a dictionary", "checks if a binary tree is balanced",
    "implements binary search over a sorted list of {things}", "computes the edit distance between two strings",
    "returns the intersection of two lists of {things} without duplicates", "generates all subsets of a set",
    "finds the shortest path in a grid with obstacles", "detects a cycle in a linked list",
    "converts a string to title case except for small words", "masks all but the last {n} characters of a string",
    "paginates a list of {things} with {n} items per page", "computes the checksum of a file in chunks",
    "tokenizes an arithmetic expression", "evaluates a postfix expression",
    "throttles calls to a function to once every {n} seconds", "transposes a list of lists",
)
FORMATS = ("email address", "IPv4 address", "hex color code", "ISO date", "US phone number", "postal code",
           "URL", "credit card number (Luhn check)", "password with at least {n} characters", "semantic version")
UNITS = (("Celsius", "Fahrenheit"), ("kilometers", "miles"), ("bytes", "a human-readable size"),
         ("minutes", "hours and minutes"), ("RGB values", "a hex color"), ("a Unix timestamp", "a date string"))
CONSTRAINTS = ("", "", "", " Use type hints.", " Include a docstring.", " Do not use any imports.",
               " Add a few test cases.", " Keep it short.", " Explain the time complexity.", " Handle empty input.",
               " Make it efficient for large inputs.", " Add comments to explain the logic.")
WRITE = ("Write a {lang} function that {task}.", "Implement a {lang} function that {task}.",
         "Can you write {lang} code that {task}?", "Show me how to write a function in {lang} that {task}.",
         "I need a {lang} function that {task}. Can you help?", "Create a {lang} function that {task}.")
CLASSES = ("a stack", "a queue", "a bank account with deposits and withdrawals", "a to-do list",
           "a shopping cart", "an LRU cache of size {n}", "a 2D vector with addition and dot product",
           "a temperature sensor reading", "a library that lends books", "a simple state machine",
           "a timer that can be paused and resumed", "a matrix with multiplication", "a priority queue",
           "a rate limiter", "an inventory of products", "a deck of playing cards")
OTHER = (
    "Write a {lang} class that represents {cls}.",
    "Design a class for {cls} in {lang} and show how to use it.",
    "Write unit tests in {lang} for a function that {task}.",
    "Write a SQL query that finds the top {n} customers by total order amount.",
    "Write a SQL query that lists {things} added in the last {n} days, newest first.",
    "Write a SQL query that counts orders per month for the year {year}.",
    "Write a shell command that finds all files modified in the last {n} days.",
    "Write a bash script that renames every .txt file in a folder to .md.",
    "Write a regular expression that matches a {format}.",
    "What is the difference between a list and a tuple in {lang}? Show code.",
    "Refactor a {lang} function that {task} to make it more readable. Write the before and after.",
    "How would you test a {lang} function that {task}?",
    "Write a {lang} program that reads numbers from standard input and prints their sum and mean.",
    "Write a command-line tool in {lang} that {task}.",
)
SNIPPETS = (
    "result = [x * x for x in range({n}) if x % 2 == 0]",
    "counts = {{}}\nfor word in text.split():\n    counts[word] = counts.get(word, 0) + 1",
    "total = sum(price * qty for price, qty in items)",
    "data = sorted(records, key=lambda r: (r['age'], r['name']))",
    "with open('log.txt') as fh:\n    errors = [line for line in fh if 'ERROR' in line]",
    "pairs = dict(zip(keys, values))",
    "value = next((x for x in items if x > {n}), None)",
    "matrix = [[0] * {n} for _ in range({n})]",
    "words = ' '.join(reversed(sentence.split()))",
    "squares = list(map(lambda v: v ** 2, filter(None, numbers)))",
)
EXPLAIN = ("What does this Python code do?\n\n```python\n{code}\n```",
           "Explain this code line by line:\n\n```python\n{code}\n```",
           "Is there a bug in this code? If so, fix it.\n\n```python\n{code}\n```",
           "Rewrite this Python code in {lang}:\n\n```python\n{code}\n```")


def _fill(template: str, r: random.Random) -> str:
    """A template with every slot filled at random (tasks and formats hold slots of their own)."""
    fields = {"lang": r.choice(LANGUAGES), "things": r.choice(THINGS), "n": r.choice((2, 3, 5, 7, 10, 20, 50, 100)),
              "year": r.randint(2015, 2025), "unit_a": "", "unit_b": ""}
    fields["unit_a"], fields["unit_b"] = r.choice(UNITS)
    fields["condition"] = r.choice(CONDITIONS).format(**fields)
    fields["format"] = r.choice(FORMATS).format(**fields)
    fields["task"] = r.choice(TASKS).format(**fields)
    fields["cls"] = r.choice(CLASSES).format(**fields)
    fields["code"] = r.choice(SNIPPETS).format(**fields)
    return template.format(**fields)


def prompts(rng: random.Random) -> Iterator[Prompt]:
    """Endless programming prompts: about half "write a function that ...", the rest classes, tests, SQL, shell,
    regular expressions and code to explain, fix or translate."""
    for n in range(10**9):
        kind = rng.random()
        pool = WRITE if kind < 0.5 else (OTHER if kind < 0.85 else EXPLAIN)
        text = _fill(rng.choice(pool), rng) + (rng.choice(CONSTRAINTS) if pool is not EXPLAIN else "")
        yield user_prompt(f"{CATEGORY}:{n}", CATEGORY, text)
