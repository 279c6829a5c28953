"""Generated arithmetic and word problems (templates filled from a seeded generator), each with its computed answer,
which the follow-up source continues from.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from fractions import Fraction

from dflash_lightning.regenerate.prompts.records import Prompt, user_prompt

Problem = tuple[str, str]  # (question, answer)

STEPS = ("", "", " Show your work.", " Explain each step.", " Give only the final answer.", " Think step by step.")


def _num(x: float) -> str:
    """A number as a person writes it: no trailing .0, at most two decimals."""
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}".rstrip("0").rstrip(".")


def _binary(r: random.Random) -> Problem:
    a, b = r.randint(2, 999), r.randint(2, 999)
    op, word, value = r.choice([("+", "plus", a + b), ("-", "minus", a - b), ("*", "times", a * b)])
    ask = r.choice(("What is {a} {op} {b}?", "Calculate {a} {op} {b}.", "Compute {a} {word} {b}.",
                    "What do you get when you take {a} {word} {b}?", "{a} {op} {b} = ?"))
    return ask.format(a=a, b=b, op=op, word=word), _num(value)


def _division(r: random.Random) -> Problem:
    b = r.randint(2, 60)
    a = b * r.randint(2, 200) + r.choice((0, 0, r.randint(1, b - 1)))
    q, rem = divmod(a, b)
    if r.random() < 0.5:
        return f"What is {a} divided by {b}? Give the quotient and the remainder.", f"{q} remainder {rem}"
    return f"Divide {a} by {b} and round to two decimal places.", _num(round(a / b, 2))


def _expression(r: random.Random) -> Problem:
    a, b, c, d = (r.randint(1, 50) for _ in range(4))
    form = r.choice(("({a} + {b}) * {c} - {d}", "{a} * {b} + {c} * {d}", "{a} + {b} * {c} - {d}",
                     "({a} - {b}) * ({c} + {d})", "{a} * ({b} + {c}) - {d}"))
    text = form.format(a=a, b=b, c=c, d=d)
    return f"Evaluate {text}.", _num(eval(text))  # the expression is built here from integers only


def _percent(r: random.Random) -> Problem:
    p, n = r.choice((5, 10, 12, 15, 20, 25, 30, 40, 50, 60, 75, 80, 120)), r.randint(2, 400) * 5
    kind = r.randrange(3)
    if kind == 0:
        return f"What is {p}% of {n}?", _num(p * n / 100)
    if kind == 1:
        return f"A price of ${n} goes up by {p}%. What is the new price?", f"${_num(n * (100 + p) / 100)}"
    return f"What percentage of {n} is {_num(p * n / 100)}?", f"{p}%"


def _fractions(r: random.Random) -> Problem:
    a, b, c, d = r.randint(1, 9), r.randint(2, 12), r.randint(1, 9), r.randint(2, 12)
    op, word, value = r.choice([("+", "Add", Fraction(a, b) + Fraction(c, d)),
                                ("-", "Subtract", Fraction(a, b) - Fraction(c, d)),
                                ("*", "Multiply", Fraction(a, b) * Fraction(c, d))])
    return f"{word} the fractions {a}/{b} and {c}/{d} ({a}/{b} {op} {c}/{d}) and simplify the result.", str(value)


def _equation(r: random.Random) -> Problem:
    x, a, b = r.randint(-20, 20), r.randint(2, 15), r.randint(-50, 50)
    c = a * x + b
    sign = "+" if b >= 0 else "-"
    var = r.choice("xyzn")
    return f"Solve for {var}: {a}{var} {sign} {abs(b)} = {c}.", f"{var} = {x}"


def _number_theory(r: random.Random) -> Problem:
    kind = r.randrange(5)
    a, b = r.randint(6, 300), r.randint(6, 300)
    if kind == 0:
        return f"Find the greatest common divisor of {a} and {b}.", str(math.gcd(a, b))
    if kind == 1:
        return f"What is the least common multiple of {a} and {b}?", str(math.lcm(a, b))
    if kind == 2:
        n = r.randint(20, 2000)
        prime = n > 1 and all(n % k for k in range(2, math.isqrt(n) + 1))
        return f"Is {n} a prime number?", "yes" if prime else "no"
    if kind == 3:
        return f"What is the remainder when {a * 7} is divided by {b % 23 + 2}?", str(a * 7 % (b % 23 + 2))
    base, k = r.randint(2, 12), r.randint(2, 5)
    return r.choice((f"What is {base} to the power of {k}?", f"Calculate {base}^{k}.")), str(base**k)


def _roots_and_stats(r: random.Random) -> Problem:
    kind = r.randrange(3)
    if kind == 0:
        n = r.randint(2, 60)
        return f"What is the square root of {n * n}?", str(n)
    values = [r.randint(1, 100) for _ in range(r.randint(4, 8))]
    listed = ", ".join(map(str, values))
    if kind == 1:
        return f"What is the average of {listed}?", _num(round(sum(values) / len(values), 2))
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return f"Find the median of these numbers: {listed}.", _num(median)


UNITS = (("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("hours", "minutes", 60),
         ("minutes", "seconds", 60), ("kilograms", "grams", 1000), ("liters", "milliliters", 1000),
         ("feet", "inches", 12), ("yards", "feet", 3), ("days", "hours", 24), ("weeks", "days", 7))


def _units(r: random.Random) -> Problem:
    big, small, factor = r.choice(UNITS)
    n = r.randint(2, 90) / r.choice((1, 1, 2, 4))
    if r.random() < 0.5:
        return f"Convert {_num(n)} {big} to {small}.", f"{_num(n * factor)} {small}"
    return f"How many {big} are {_num(n * factor)} {small}?", f"{_num(n)} {big}"


ARITHMETIC: tuple[Callable[[random.Random], Problem], ...] = (
    _binary, _division, _expression, _percent, _fractions, _equation, _number_theory, _roots_and_stats, _units,
)


def problems(category: str, makers: tuple[Callable[[random.Random], Problem], ...],
             rng: random.Random) -> Iterator[Prompt]:
    """Endless problems of `makers` (one at random each time), their answers as the reference."""
    for n in range(10**9):
        question, answer = rng.choice(makers)(rng)
        yield user_prompt(f"{category}:{n}", category, question + rng.choice(STEPS), answer)


def arithmetic(rng: random.Random) -> Iterator[Prompt]:
    """Arithmetic questions: operations, fractions, percentages, equations, number theory, statistics, units."""
    return problems("arithmetic", ARITHMETIC, rng)


NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Kira", "Liam", "Maya",
         "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe")
ITEMS = (("notebook", "notebooks"), ("apple", "apples"), ("pencil", "pencils"), ("ticket", "tickets"),
         ("book", "books"), ("sandwich", "sandwiches"), ("plant", "plants"), ("candle", "candles"),
         ("cup of coffee", "cups of coffee"), ("toy car", "toy cars"), ("bag of rice", "bags of rice"))
PLACES = ("the market", "school", "the library", "the park", "the station", "her aunt's house", "the beach")


def _shopping(r: random.Random) -> Problem:
    name, (one, many) = r.choice(NAMES), r.choice(ITEMS)
    k, price = r.randint(2, 12), r.randint(2, 40) / r.choice((1, 2, 4))
    total = k * price
    paid = math.ceil(total / 10) * 10 + r.choice((0, 10, 20))
    return (f"{name} buys {k} {many} at ${_num(price)} per {one} and pays with ${paid}. How much change does "
            f"{name} get?", f"${_num(paid - total)}")


def _travel(r: random.Random) -> Problem:
    name, speed, hours = r.choice(NAMES), r.randint(3, 120), r.randint(1, 9) / r.choice((1, 2))
    place = r.choice(PLACES)
    if r.random() < 0.5:
        return (f"{name} travels to {place} at {speed} km/h for {_num(hours)} hours. How far does {name} go?",
                f"{_num(speed * hours)} km")
    return (f"{name} needs to cover {_num(speed * hours)} km at a steady {speed} km/h. How long does the trip take?",
            f"{_num(hours)} hours")


def _sharing(r: random.Random) -> Problem:
    name, (_, many) = r.choice(NAMES), r.choice(ITEMS)
    friends, each, extra = r.randint(2, 9), r.randint(2, 15), r.randint(0, 5)
    total = friends * each + extra
    return (f"{name} has {total} {many} and shares them equally among {friends} friends. How many does each friend "
            f"get, and how many are left over?", f"{each} each, {extra} left over")


def _saving(r: random.Random) -> Problem:
    name, goal, weekly, start = r.choice(NAMES), r.randint(50, 900), r.randint(5, 60), r.randint(0, 40)
    weeks = max(0, math.ceil((goal - start) / weekly))
    return (f"{name} has ${start} and saves ${weekly} every week. After how many weeks will {name} have at least "
            f"${goal}?", f"{weeks} weeks")


def _ages(r: random.Random) -> Problem:
    a, b = r.sample(NAMES, 2)
    young, gap, years = r.randint(3, 30), r.randint(2, 30), r.randint(2, 15)
    return (f"{a} is {gap} years older than {b}. {b} is {young} now. How old will {a} be in {years} years?",
            f"{young + gap + years}")


def _work(r: random.Random) -> Problem:
    a, b = r.sample(NAMES, 2)
    x, y = r.choice(((2, 3), (3, 6), (4, 12), (5, 20), (6, 3), (10, 15), (12, 4), (6, 12)))
    return (f"{a} can paint a fence in {x} hours and {b} can paint it in {y} hours. How long does it take them "
            f"working together?", f"{_num(x * y / (x + y))} hours")


def _area(r: random.Random) -> Problem:
    name, w, h, cost = r.choice(NAMES), r.randint(2, 40), r.randint(2, 40), r.randint(2, 25)
    kind = r.choice(("a garden", "a room", "a patio", "a field", "a classroom floor"))
    return (f"{name} wants to cover {kind} that is {w} m by {h} m. Covering costs ${cost} per square meter. What "
            f"is the total cost?", f"${w * h * cost}")


def _recipe(r: random.Random) -> Problem:
    name, serves, want, flour = r.choice(NAMES), r.choice((2, 4, 6, 8)), r.choice((3, 5, 10, 12, 16)), r.randint(1, 9)
    amount = Fraction(flour * 50 * want, serves)
    return (f"A recipe for {serves} people needs {flour * 50} g of flour. {name} cooks for {want} people. How much "
            f"flour is needed?", f"{_num(float(amount))} g")


def _interest(r: random.Random) -> Problem:
    name, p, rate, years = r.choice(NAMES), r.randint(1, 50) * 100, r.choice((2, 3, 4, 5, 6, 8)), r.randint(1, 5)
    if r.random() < 0.5:
        return (f"{name} puts ${p} in an account with {rate}% simple interest per year. How much interest does it "
                f"earn in {years} years?", f"${_num(p * rate * years / 100)}")
    return (f"{name} invests ${p} at {rate}% interest compounded yearly. What is it worth after {years} years, to "
            f"the nearest cent?", f"${p * (1 + rate / 100) ** years:.2f}")


WORD_PROBLEMS: tuple[Callable[[random.Random], Problem], ...] = (
    _shopping, _travel, _sharing, _saving, _ages, _work, _area, _recipe, _interest,
)


def word_problems(rng: random.Random) -> Iterator[Prompt]:
    """Short word problems: shopping, travel, sharing, saving, ages, work rates, areas, recipes, interest."""
    return problems("word_problems", WORD_PROBLEMS, rng)
