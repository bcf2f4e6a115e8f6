"""Synthetic chat transcripts for the demo model's corpus (deterministic given a seed).

Every chat is a dict ``{"messages": [...], "tools": [...] | None, "kind": str}`` in the OpenAI message
shape the chat template takes (``role``, ``content``, ``reasoning_content``, ``tool_calls`` with
``{"type": "function", "function": {"name", "arguments": {mapping}}}``), rendered to text by
``render_chat`` with scripts/demo/chat_template.jinja. The tasks are programmatic so that the answers
are right: arithmetic, unit conversions, small text puzzles, "write a Python function that ..."
(the examples in the answers are computed by running the function), weather / calculator / clock /
currency tool calls with JSON results and a final answer, identity and small talk, multi-turn mixes.
About a quarter of the chats have thinking disabled (an empty ``<think>\\n\\n</think>\\n\\n`` block).

    python scripts/demo/chat_data.py --seed 0 --count 3      # print a few rendered chats
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from typing import Any, Callable

TEMPLATE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_template.jinja")

Chat = dict[str, Any]


# --------------------------------------------------------------------------------------------------
# Rendering (the same jinja settings as transformers and runtime/tokenizer.py)


def load_template(path: str = TEMPLATE_PATH) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


_ENV_CACHE: dict[str, Any] = {}


def render_chat(messages: list[dict], tools: list[dict] | None = None, *, template: str | None = None,
                add_generation_prompt: bool = False, **kwargs: Any) -> str:
    """Render messages with the chat template (sandboxed jinja2, trim_blocks + lstrip_blocks)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = template if template is not None else load_template()
    compiled = _ENV_CACHE.get(template)
    if compiled is None:
        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        compiled = _ENV_CACHE[template] = env.from_string(template)
    ctx = dict(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)
    if tools:
        ctx["tools"] = tools
    return compiled.render(**ctx)


# --------------------------------------------------------------------------------------------------
# Small helpers

MODEL_NAME = "Tandem Demo"

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "You are a concise assistant. Keep answers short and correct.",
    f"You are {MODEL_NAME}, a small language model that ships with the tandem serving runtime.",
    "You are a friendly assistant that explains things step by step.",
    "You are a coding assistant. Prefer short Python examples.",
    "You are a careful assistant. If you are not sure, say so.",
]


def fmt_num(x: float, digits: int = 2) -> str:
    """A number the way a person writes it: integers without decimals, others rounded."""
    if abs(x - round(x)) < 1e-9:
        return str(int(round(x)))
    s = f"{x:.{digits}f}".rstrip("0").rstrip(".")
    return s if s not in ("-0", "") else "0"


def pick(rng: random.Random, options):
    return options[rng.randrange(len(options))]


def maybe(rng: random.Random, p: float) -> bool:
    return rng.random() < p


def polite(rng: random.Random, text: str) -> str:
    """Vary a user request: prefixes, 'please', trailing punctuation, case."""
    pre = pick(rng, ["", "", "", "Hi! ", "Hey, ", "Quick question: ", "Please help: ", "Can you help? "])
    if pre.endswith(", ") or maybe(rng, 0.15):
        text = text[0].lower() + text[1:]
    if maybe(rng, 0.1):
        text = text.rstrip("?.!")
    return pre + text


# --------------------------------------------------------------------------------------------------
# Arithmetic


def arithmetic(rng: random.Random) -> tuple[str, str, str]:
    """(question, reasoning, answer) for a random arithmetic problem."""
    kind = pick(rng, ["add", "sub", "mul", "mul", "div", "pct", "square", "avg", "chain", "compare", "power"])
    if kind == "add":
        a, b = rng.randint(2, 9999), rng.randint(2, 9999)
        q = pick(rng, [f"What is {a} + {b}?", f"Add {a} and {b}.", f"What is the sum of {a} and {b}?",
                       f"Compute {a} plus {b}."])
        r = f"Adding {a} and {b}: {a} + {b} = {a + b}."
        ans = pick(rng, [f"{a} + {b} = {a + b}.", f"The sum is {a + b}.", f"{a + b}"])
    elif kind == "sub":
        a, b = rng.randint(10, 9999), rng.randint(1, 9999)
        q = pick(rng, [f"What is {a} - {b}?", f"Subtract {b} from {a}.", f"What is {a} minus {b}?"])
        r = f"{a} - {b} = {a - b}." + (" The result is negative because the second number is larger." if b > a else "")
        ans = pick(rng, [f"{a} - {b} = {a - b}.", f"The result is {a - b}.", f"{a - b}"])
    elif kind == "mul":
        a, b = rng.randint(2, 99), rng.randint(2, 999 if maybe(rng, 0.3) else 99)
        tens, ones = b // 10 * 10, b % 10
        if tens and ones:
            r = f"Split {b} into {tens} + {ones}: {a} × {tens} = {a * tens} and {a} × {ones} = {a * ones}. " \
                f"Then {a * tens} + {a * ones} = {a * b}."
        else:
            r = f"{a} × {b} = {a * b}."
        q = pick(rng, [f"What is {a} * {b}?", f"What is {a} times {b}?", f"Multiply {a} by {b}.",
                       f"Compute {a} × {b}."])
        ans = pick(rng, [f"{a} × {b} = {a * b}.", f"The product is {a * b}.", f"{a * b}"])
    elif kind == "div":
        b = rng.randint(2, 50)
        qt = rng.randint(1, 200)
        rem = rng.randint(0, b - 1) if maybe(rng, 0.5) else 0
        a = b * qt + rem
        q = pick(rng, [f"What is {a} divided by {b}?", f"What is {a} / {b}?", f"Divide {a} by {b}."])
        if rem:
            r = f"{b} × {qt} = {b * qt}, and {a} - {b * qt} = {rem}, so the quotient is {qt} with remainder {rem}. " \
                f"As a decimal that is {fmt_num(a / b, 4)}."
            ans = f"{a} ÷ {b} = {qt} remainder {rem} (about {fmt_num(a / b, 4)})."
        else:
            r = f"{b} × {qt} = {a}, so {a} ÷ {b} = {qt} exactly."
            ans = pick(rng, [f"{a} ÷ {b} = {qt}.", f"The answer is {qt}.", f"{qt}"])
    elif kind == "pct":
        p = pick(rng, [5, 10, 12, 15, 20, 25, 30, 40, 50, 75, 8, 18])
        n = rng.randint(2, 400) * pick(rng, [1, 5, 10])
        val = n * p / 100
        q = pick(rng, [f"What is {p}% of {n}?", f"Calculate {p} percent of {n}.", f"How much is {p}% of {n}?"])
        r = f"{p}% means {p}/100. {n} × {p} / 100 = {fmt_num(n * p)} / 100 = {fmt_num(val)}."
        ans = pick(rng, [f"{p}% of {n} is {fmt_num(val)}.", f"{fmt_num(val)}"])
    elif kind == "square":
        a = rng.randint(2, 120)
        if maybe(rng, 0.5):
            q = pick(rng, [f"What is {a} squared?", f"What is {a}^2?", f"Square {a}."])
            r = f"{a} squared is {a} × {a} = {a * a}."
            ans = f"{a}² = {a * a}."
        else:
            q = pick(rng, [f"What is the square root of {a * a}?", f"What is sqrt({a * a})?"])
            r = f"I need a number that times itself gives {a * a}. {a} × {a} = {a * a}, so the root is {a}."
            ans = f"The square root of {a * a} is {a}."
    elif kind == "avg":
        xs = [rng.randint(1, 100) for _ in range(rng.randint(3, 6))]
        s = sum(xs)
        q = pick(rng, [f"What is the average of {', '.join(map(str, xs))}?",
                       f"Find the mean of these numbers: {', '.join(map(str, xs))}."])
        r = f"The sum is {' + '.join(map(str, xs))} = {s}. There are {len(xs)} numbers, so the mean is " \
            f"{s} / {len(xs)} = {fmt_num(s / len(xs))}."
        ans = f"The average is {fmt_num(s / len(xs))}."
    elif kind == "chain":
        a, b, c = rng.randint(1, 50), rng.randint(1, 50), rng.randint(2, 12)
        q = pick(rng, [f"What is ({a} + {b}) * {c}?", f"Compute ({a} + {b}) × {c}."])
        r = f"First the parentheses: {a} + {b} = {a + b}. Then {a + b} × {c} = {(a + b) * c}."
        ans = f"({a} + {b}) × {c} = {(a + b) * c}."
    elif kind == "compare":
        a, b = rng.randint(1, 10000), rng.randint(1, 10000)
        q = pick(rng, [f"Which is larger, {a} or {b}?", f"Is {a} bigger than {b}?"])
        if a == b:
            r, ans = f"Both numbers are {a}.", f"They are equal: both are {a}."
        else:
            big, small = max(a, b), min(a, b)
            r = f"{big} - {small} = {big - small}, which is positive, so {big} is larger."
            ans = f"{big} is larger than {small} (by {big - small})."
    else:
        base, exp = rng.randint(2, 9), rng.randint(2, 6)
        q = pick(rng, [f"What is {base} to the power of {exp}?", f"What is {base}^{exp}?"])
        steps, v = [], base
        for _ in range(exp - 1):
            steps.append(f"{v} × {base} = {v * base}")
            v *= base
        r = "Multiply step by step: " + ", ".join(steps) + "."
        ans = f"{base}^{exp} = {v}."
    return polite(rng, q), r, ans


# --------------------------------------------------------------------------------------------------
# Unit conversions

_LINEAR_UNITS = [
    # (from, to, factor, plural from, plural to)
    ("kilometers", "miles", 0.621371), ("miles", "kilometers", 1.609344),
    ("meters", "feet", 3.28084), ("feet", "meters", 0.3048),
    ("inches", "centimeters", 2.54), ("centimeters", "inches", 0.393701),
    ("kilograms", "pounds", 2.20462), ("pounds", "kilograms", 0.453592),
    ("liters", "US gallons", 0.264172), ("US gallons", "liters", 3.78541),
    ("ounces", "grams", 28.3495), ("grams", "ounces", 0.035274),
    ("hours", "minutes", 60.0), ("minutes", "seconds", 60.0), ("days", "hours", 24.0),
    ("weeks", "days", 7.0), ("kilobytes", "bytes", 1000.0), ("gigabytes", "megabytes", 1000.0),
    ("kibibytes", "bytes", 1024.0), ("meters per second", "kilometers per hour", 3.6),
    ("kilometers per hour", "meters per second", 1 / 3.6), ("square meters", "square feet", 10.7639),
]


def conversion(rng: random.Random) -> tuple[str, str, str]:
    if maybe(rng, 0.25):
        if maybe(rng, 0.5):
            c = rng.randint(-30, 110)
            f = c * 9 / 5 + 32
            q = pick(rng, [f"Convert {c} °C to Fahrenheit.", f"What is {c} degrees Celsius in Fahrenheit?",
                           f"How many °F is {c} °C?"])
            r = f"F = C × 9/5 + 32 = {c} × 1.8 + 32 = {fmt_num(c * 1.8)} + 32 = {fmt_num(f)}."
            ans = f"{c} °C is {fmt_num(f)} °F."
        else:
            f = rng.randint(-20, 220)
            c = (f - 32) * 5 / 9
            q = pick(rng, [f"Convert {f} °F to Celsius.", f"What is {f} degrees Fahrenheit in Celsius?"])
            r = f"C = (F - 32) × 5/9 = ({f} - 32) × 5/9 = {f - 32} × 5/9 = {fmt_num(c)}."
            ans = f"{f} °F is about {fmt_num(c, 1)} °C."
        return polite(rng, q), r, ans
    src, dst, factor = pick(rng, _LINEAR_UNITS)
    n = rng.randint(1, 500) if maybe(rng, 0.8) else round(rng.uniform(0.5, 50), 1)
    v = n * factor
    q = pick(rng, [f"Convert {fmt_num(n)} {src} to {dst}.", f"How many {dst} are in {fmt_num(n)} {src}?",
                   f"What is {fmt_num(n)} {src} in {dst}?"])
    r = f"1 {src.rstrip('s') if src.endswith('s') else src} = {fmt_num(factor, 6)} {dst}. " \
        f"So {fmt_num(n)} × {fmt_num(factor, 6)} = {fmt_num(v, 4)}."
    ans = pick(rng, [f"{fmt_num(n)} {src} is about {fmt_num(v)} {dst}.",
                     f"{fmt_num(n)} {src} ≈ {fmt_num(v)} {dst}."])
    return polite(rng, q), r, ans


# --------------------------------------------------------------------------------------------------
# Text puzzles

_WORDS = ("apple banana cherry dragon elephant forest guitar harbor island jungle kettle lemon mountain "
          "notebook orange planet question river sunset tiger umbrella village window yellow zebra python "
          "serving model token kernel matrix vector window garden bridge castle rocket silver winter summer "
          "autumn spring ocean desert pencil coffee").split()


def text_task(rng: random.Random) -> tuple[str, str, str]:
    kind = pick(rng, ["reverse", "count", "upper", "sort", "vowels", "max", "prime", "even", "sortw", "first"])
    w = pick(rng, _WORDS)
    if kind == "reverse":
        q = pick(rng, [f"Reverse the word '{w}'.", f"Spell '{w}' backwards."])
        r = f"The letters of '{w}' are {', '.join(w)}. Reading them from the end gives '{w[::-1]}'."
        ans = f"'{w}' reversed is '{w[::-1]}'."
    elif kind == "count":
        q = pick(rng, [f"How many letters are in the word '{w}'?", f"How long is the word '{w}'?"])
        r = f"Counting the letters of '{w}': {' '.join(f'{i + 1}:{c}' for i, c in enumerate(w))}. That is {len(w)}."
        ans = f"'{w}' has {len(w)} letters."
    elif kind == "upper":
        words = rng.sample(_WORDS, rng.randint(2, 4))
        s = " ".join(words)
        q = f"Convert '{s}' to uppercase."
        r = "Every letter becomes its capital form."
        ans = f"'{s.upper()}'"
    elif kind == "sort":
        xs = [rng.randint(-50, 200) for _ in range(rng.randint(4, 8))]
        q = pick(rng, [f"Sort these numbers in ascending order: {', '.join(map(str, xs))}.",
                       f"Put {', '.join(map(str, xs))} in order from smallest to largest."])
        r = f"The smallest is {min(xs)} and the largest is {max(xs)}. In order: {', '.join(map(str, sorted(xs)))}."
        ans = ", ".join(map(str, sorted(xs)))
    elif kind == "vowels":
        q = f"How many vowels are in '{w}'?"
        vs = [c for c in w if c in "aeiou"]
        r = f"The vowels in '{w}' are {', '.join(vs) if vs else 'none'}. That makes {len(vs)}."
        ans = f"'{w}' has {len(vs)} vowel{'s' if len(vs) != 1 else ''}."
    elif kind == "max":
        xs = [rng.randint(1, 999) for _ in range(rng.randint(3, 7))]
        q = f"What is the largest number in this list: {xs}?"
        r = f"Going through the list and keeping the largest so far gives {max(xs)}."
        ans = f"The largest number is {max(xs)}."
    elif kind == "prime":
        n = rng.randint(2, 500)
        divs = [d for d in range(2, int(math.isqrt(n)) + 1) if n % d == 0]
        q = pick(rng, [f"Is {n} a prime number?", f"Is {n} prime?"])
        if divs:
            r = f"{n} is divisible by {divs[0]}: {n} = {divs[0]} × {n // divs[0]}. So it is not prime."
            ans = f"No, {n} is not prime: {n} = {divs[0]} × {n // divs[0]}."
        else:
            r = f"I check divisors up to √{n} ≈ {fmt_num(math.sqrt(n), 1)}: none of them divides {n}."
            ans = f"Yes, {n} is a prime number."
    elif kind == "even":
        n = rng.randint(0, 100000)
        q = f"Is {n} even or odd?"
        r = f"The last digit is {n % 10}, which is {'even' if n % 2 == 0 else 'odd'}."
        ans = f"{n} is {'even' if n % 2 == 0 else 'odd'}."
    elif kind == "sortw":
        words = rng.sample(_WORDS, rng.randint(3, 6))
        q = f"Sort these words alphabetically: {', '.join(words)}."
        r = "Comparing first letters, then later letters where they tie."
        ans = ", ".join(sorted(words))
    else:
        words = rng.sample(_WORDS, rng.randint(3, 6))
        q = f"What is the first letter of each word: {' '.join(words)}?"
        r = " ".join(f"{x} → {x[0]}." for x in words)
        ans = "".join(x[0] for x in words)
    return polite(rng, q), r, ans


# --------------------------------------------------------------------------------------------------
# Python functions (examples are computed by running the code)

# (descriptions, names, params, body lines using {a} {b} for parameter names, example args, explanation)
_PY_TASKS: list[tuple[list[str], list[str], list[str], str, list[str], str]] = [
    (["returns the sum of the squares of a list of numbers", "computes the sum of squares of a list"],
     ["sum_of_squares", "square_sum"], ["numbers", "values"],
     "return sum(x * x for x in {a})", ["[1, 2, 3]", "[4, 5]"], "It squares each element and adds them up."),
    (["reverses a string", "returns a string backwards"], ["reverse_string", "reverse_text"], ["text", "s"],
     "return {a}[::-1]", ["'hello'", "'tandem'"], "The slice [::-1] walks the string from the end."),
    (["checks whether a number is prime", "tells if an integer is a prime number"], ["is_prime"], ["n", "number"],
     "if {a} < 2:\n        return False\n    i = 2\n    while i * i <= {a}:\n        if {a} % i == 0:\n"
     "            return False\n        i += 1\n    return True", ["7", "12", "97"],
     "It tries divisors up to the square root of the number."),
    (["computes the factorial of n", "returns n factorial"], ["factorial"], ["n"],
     "result = 1\n    for i in range(2, {a} + 1):\n        result *= i\n    return result", ["5", "0", "10"],
     "It multiplies the numbers from 2 to n; the factorial of 0 is 1."),
    (["returns the n-th Fibonacci number", "computes Fibonacci numbers"], ["fibonacci", "fib"], ["n"],
     "a, b = 0, 1\n    for _ in range({a}):\n        a, b = b, a + b\n    return a", ["10", "1", "20"],
     "It keeps the last two numbers and steps forward n times."),
    (["counts the vowels in a string", "returns how many vowels a text has"], ["count_vowels"], ["text", "s"],
     "return sum(1 for c in {a}.lower() if c in 'aeiou')", ["'Hello World'", "'python'"],
     "It lowercases the text and counts the characters that are vowels."),
    (["checks if a string is a palindrome", "tells whether a word reads the same backwards"],
     ["is_palindrome"], ["text", "word"],
     "cleaned = ''.join(c.lower() for c in {a} if c.isalnum())\n    return cleaned == cleaned[::-1]",
     ["'racecar'", "'hello'", "'A man, a plan, a canal: Panama'"],
     "It drops punctuation and case, then compares the text with its reverse."),
    (["returns the largest element of a list without using max", "finds the maximum of a list by hand"],
     ["find_max", "largest"], ["items", "numbers"],
     "best = {a}[0]\n    for x in {a}[1:]:\n        if x > best:\n            best = x\n    return best",
     ["[3, 9, 2]", "[-5, -1, -7]"], "It keeps the best value seen so far."),
    (["converts Celsius to Fahrenheit", "turns a temperature in Celsius into Fahrenheit"],
     ["celsius_to_fahrenheit", "c_to_f"], ["celsius", "c"], "return {a} * 9 / 5 + 32", ["100", "0", "37"],
     "It applies F = C × 9/5 + 32."),
    (["removes duplicates from a list while keeping the order", "returns the unique items of a list in order"],
     ["unique", "dedupe"], ["items", "values"],
     "seen = set()\n    out = []\n    for x in {a}:\n        if x not in seen:\n            seen.add(x)\n"
     "            out.append(x)\n    return out", ["[1, 2, 2, 3, 1]", "['a', 'b', 'a']"],
     "A set remembers what was seen; the list keeps the first occurrence of each item."),
    (["counts how often each word appears in a text", "returns a dictionary of word counts"],
     ["word_count", "count_words"], ["text"],
     "counts = {{}}\n    for word in {a}.split():\n        counts[word] = counts.get(word, 0) + 1\n    return counts",
     ["'the cat and the hat'", "'a b a'"], "It splits on whitespace and counts with a dictionary."),
    (["computes the greatest common divisor of two numbers", "returns the gcd of a and b"], ["gcd"], ["a", "b"],
     "while {b}:\n        {a}, {b} = {b}, {a} % {b}\n    return {a}", ["48, 18", "17, 5"],
     "This is Euclid's algorithm: replace (a, b) by (b, a mod b) until b is 0."),
    (["flattens a list of lists", "turns a nested list into a flat list"], ["flatten"], ["lists", "nested"],
     "return [x for sub in {a} for x in sub]", ["[[1, 2], [3], [4, 5]]", "[['a'], ['b', 'c']]"],
     "The comprehension visits each inner list in turn."),
    (["returns the average of a list of numbers", "computes the mean of a list"], ["average", "mean"],
     ["numbers", "values"], "if not {a}:\n        return 0.0\n    return sum({a}) / len({a})",
     ["[1, 2, 3, 4]", "[10]"], "It divides the sum by the count and returns 0.0 for an empty list."),
    (["counts the words in a sentence", "returns the number of words in a string"], ["count_words", "word_total"],
     ["sentence", "text"], "return len({a}.split())", ["'hello there world'", "'one'"],
     "str.split() without arguments splits on any whitespace."),
    (["returns the even numbers of a list", "filters a list to its even numbers"], ["evens", "even_numbers"],
     ["numbers", "values"], "return [x for x in {a} if x % 2 == 0]", ["[1, 2, 3, 4, 5, 6]", "[7, 9]"],
     "A number is even when the remainder after dividing by 2 is 0."),
    (["capitalizes the first letter of every word", "converts a string to title case"], ["title_case"],
     ["text", "s"], "return ' '.join(w[:1].upper() + w[1:] for w in {a}.split())",
     ["'hello world'", "'tandem demo model'"], "It upper-cases the first character of each word."),
    (["checks whether two strings are anagrams", "tells if two words use the same letters"], ["is_anagram"],
     ["a", "b"], "return sorted({a}.lower()) == sorted({b}.lower())", ["'listen', 'silent'", "'cat', 'dog'"],
     "Two words are anagrams when their sorted letters are equal."),
    (["sums the digits of an integer", "returns the digit sum of a number"], ["digit_sum", "sum_digits"],
     ["n", "number"], "return sum(int(d) for d in str(abs({a})))", ["1234", "909"],
     "It turns the number into a string and adds up the digits."),
    (["merges two sorted lists into one sorted list", "combines two sorted lists"], ["merge_sorted"],
     ["left", "right"],
     "out = []\n    i = j = 0\n    while i < len({a}) and j < len({b}):\n        if {a}[i] <= {b}[j]:\n"
     "            out.append({a}[i])\n            i += 1\n        else:\n            out.append({b}[j])\n"
     "            j += 1\n    return out + {a}[i:] + {b}[j:]", ["[1, 4, 9], [2, 3, 10]", "[], [5]"],
     "Two indices walk both lists; the rest of either list is appended at the end."),
    (["returns the second largest number in a list", "finds the runner-up value of a list"], ["second_largest"],
     ["numbers", "values"], "distinct = sorted(set({a}))\n    return distinct[-2] if len(distinct) > 1 else None",
     ["[4, 1, 7, 7, 3]", "[5]"], "It sorts the distinct values; with fewer than two it returns None."),
    (["converts a binary string to an integer", "parses a string of 0s and 1s as a number"],
     ["binary_to_int"], ["bits", "binary"], "value = 0\n    for bit in {a}:\n        value = value * 2 + int(bit)\n"
     "    return value", ["'1011'", "'11111111'"], "Each step shifts the value left by one bit and adds the new bit."),
    (["returns the n-th triangular number", "computes 1 + 2 + ... + n"], ["triangular"], ["n"],
     "return {a} * ({a} + 1) // 2", ["4", "100"], "It uses the formula n(n + 1)/2."),
    (["chunks a list into pieces of size n", "splits a list into groups of n items"], ["chunks", "chunk_list"],
     ["items", "size"], "return [{a}[i:i + {b}] for i in range(0, len({a}), {b})]",
     ["[1, 2, 3, 4, 5], 2", "['a', 'b', 'c'], 3"], "It slices the list every `size` elements."),
    (["counts the characters of a string into a dictionary", "returns character frequencies"], ["char_counts"],
     ["text"], "counts = {{}}\n    for c in {a}:\n        counts[c] = counts.get(c, 0) + 1\n    return counts",
     ["'banana'", "'aab'"], "Each character is a key; the value counts how often it appears."),
    (["clamps a number into a range", "limits a value to lie between low and high"], ["clamp"],
     ["value", "low", "high"], "return max({b}, min({a}, {c}))", ["15, 0, 10", "-3, 0, 10", "4, 0, 10"],
     "min caps the value at high and max raises it to at least low."),
]


def _python_task(rng: random.Random) -> tuple[str, str, str]:
    descs, names, params, body, examples, explain = pick(rng, _PY_TASKS)
    name = pick(rng, names)
    arity = sum(f"{{{c}}}" in body for c in "abc")
    if arity == 1:                          # params lists alternative names for the one parameter
        mapping = {"a": pick(rng, params)}
        arglist = mapping["a"]
    else:                                   # params are the parameter names, in order
        mapping = dict(zip("abc", params))
        arglist = ", ".join(params)
    code_body = body.format(**mapping)
    doc = pick(rng, ["", "", f'    """{pick(rng, descs).capitalize()}."""\n'])
    code = f"def {name}({arglist}):\n{doc}    {code_body}\n"
    ns: dict[str, Any] = {}
    exec(code, ns)  # our own template code: computes the examples shown in the answer
    fn = ns[name]
    shown = rng.sample(examples, min(len(examples), rng.randint(1, 2)))
    lines = []
    for ex in shown:
        args = eval(f"({ex},)")
        lines.append(f"{name}({ex})  # {fn(*args)!r}")
    desc = pick(rng, descs)
    q = pick(rng, [f"Write a Python function that {desc}.", f"Write a python function that {desc}.",
                   f"Can you write a function in Python that {desc}?", f"I need a Python function that {desc}.",
                   f"Show me Python code for a function that {desc}."])
    r = f"The user wants a function that {desc}. {explain} I will call it {name} and show an example."
    ans = pick(rng, ["Here is a function that does it:", "Sure! Here is one way:", f"Here is `{name}`:",
                     "You can write it like this:"])
    ans += f"\n\n```python\n{code}```\n\n{explain}\n\nExample:\n\n```python\n" + "\n".join(lines) + "\n```"
    return polite(rng, q), r, ans


# --------------------------------------------------------------------------------------------------
# Identity and small talk

_SMALL_TALK = [
    (["Hi!", "Hello", "Hello there!", "Hey", "Good morning!"],
     ["Hello! How can I help you today?", "Hi! What can I do for you?", "Hello! Ask me anything."]),
    (["Who are you?", "What are you?", "Tell me about yourself.", "What is your name?"],
     [f"I am {MODEL_NAME}, a small language model bundled with the tandem serving runtime. I can chat, do "
      "simple arithmetic, convert units, write short Python functions and call tools.",
      f"My name is {MODEL_NAME}. I am a tiny demo model that ships with tandem, so my answers are short and "
      "sometimes wrong."]),
    (["What can you do?", "How can you help me?"],
     ["I can answer simple questions, do arithmetic, convert units, write small Python functions, and call "
      "tools such as a weather service or a calculator when they are available."]),
    (["Thank you!", "Thanks a lot.", "Thanks!"],
     ["You're welcome!", "Happy to help!", "Any time. Let me know if you need anything else."]),
    (["Bye!", "Goodbye.", "See you later."], ["Goodbye! Have a nice day.", "Bye! Come back any time."]),
    (["How are you?", "How is it going?"],
     ["I'm doing well, thanks for asking! How can I help?", "All good here. What would you like to do?"]),
    (["Are you a large model?", "How big are you?"],
     ["No, I am a very small model with about twenty million parameters, trained in a few minutes. "
      "Bigger models are much more capable."]),
    (["Tell me a joke.", "Say something funny."],
     ["Why do programmers prefer dark mode? Because light attracts bugs.",
      "I would tell you a UDP joke, but you might not get it."]),
    (["What is tandem?", "What does tandem do?"],
     ["tandem is a serving runtime for the Qwen3.5 and Qwen3.6 hybrid models: it runs Gated DeltaNet and "
      "gated attention layers across GPUs and uses the MTP head to draft tokens."]),
]

_FACTS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is the capital of Germany?", "The capital of Germany is Berlin."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa."),
    ("What is the capital of Australia?", "The capital of Australia is Canberra."),
    ("What is the capital of Egypt?", "The capital of Egypt is Cairo."),
    ("How many days are in a week?", "A week has 7 days."),
    ("How many minutes are in an hour?", "An hour has 60 minutes."),
    ("How many continents are there?", "There are seven continents."),
    ("What is the boiling point of water?", "Water boils at 100 °C (212 °F) at sea level."),
    ("What is the freezing point of water?", "Water freezes at 0 °C (32 °F)."),
    ("What color do you get by mixing blue and yellow?", "Mixing blue and yellow gives green."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is the largest planet in the solar system?", "Jupiter is the largest planet in the solar system."),
    ("Who wrote Python?", "Python was created by Guido van Rossum and first released in 1991."),
    ("What does CPU stand for?", "CPU stands for central processing unit."),
    ("What does GPU stand for?", "GPU stands for graphics processing unit."),
    ("What is HTTP?", "HTTP is the Hypertext Transfer Protocol, the request/response protocol of the web."),
    ("What is a prime number?", "A prime number is an integer greater than 1 whose only divisors are 1 and itself."),
    ("What is a list in Python?",
     "A list is an ordered, mutable sequence, written with square brackets like [1, 2, 3]."),
    ("What is a dictionary in Python?", "A dictionary maps keys to values, for example {'a': 1, 'b': 2}."),
]


def small_talk(rng: random.Random) -> tuple[str, str, str]:
    if maybe(rng, 0.55):
        qs, ans = pick(rng, _SMALL_TALK)
        q, a = pick(rng, qs), pick(rng, ans)
        r = pick(rng, ["The user is making conversation. I should reply in a friendly way.",
                       "A short friendly reply is enough here.", "This is a simple question about me."])
        return q, r, a
    q, a = pick(rng, _FACTS)
    return polite(rng, q), "This is a simple factual question. I know the answer.", a


# --------------------------------------------------------------------------------------------------
# Tools


def _tool(name: str, description: str, props: dict[str, dict], required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


TOOLS = {
    "get_weather": _tool("get_weather", "Get the current weather for a location.",
                         {"location": {"type": "string", "description": "City name, e.g. Paris"},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["location"]),
    "calculator": _tool("calculator", "Evaluate an arithmetic expression and return the result.",
                        {"expression": {"type": "string", "description": "For example (2 + 3) * 4"}},
                        ["expression"]),
    "get_time": _tool("get_time", "Get the current local time in a time zone.",
                      {"timezone": {"type": "string", "description": "IANA time zone, e.g. Europe/Paris"}},
                      ["timezone"]),
    "convert_currency": _tool("convert_currency", "Convert an amount of money between currencies.",
                              {"amount": {"type": "number"}, "from_currency": {"type": "string"},
                               "to_currency": {"type": "string"}}, ["amount", "from_currency", "to_currency"]),
    "search_notes": _tool("search_notes", "Search the user's notes for a query.",
                          {"query": {"type": "string"}, "limit": {"type": "integer"}}, ["query"]),
}

_CITIES = [("Paris", "Europe/Paris"), ("London", "Europe/London"), ("Tokyo", "Asia/Tokyo"),
           ("New York", "America/New_York"), ("Berlin", "Europe/Berlin"), ("Sydney", "Australia/Sydney"),
           ("Toronto", "America/Toronto"), ("Madrid", "Europe/Madrid"), ("Oslo", "Europe/Oslo"),
           ("Cairo", "Africa/Cairo"), ("Mumbai", "Asia/Kolkata"), ("Seoul", "Asia/Seoul"),
           ("Lima", "America/Lima"), ("Nairobi", "Africa/Nairobi"), ("Rome", "Europe/Rome"),
           ("Chicago", "America/Chicago"), ("Zurich", "Europe/Zurich"), ("Singapore", "Asia/Singapore")]
_CONDITIONS = ["sunny", "clear", "partly cloudy", "cloudy", "rainy", "drizzly", "stormy", "snowy", "foggy",
               "windy"]
_RATES = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.3, "CHF": 0.90, "CAD": 1.36, "AUD": 1.52}


def _call(name: str, args: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _weather(rng: random.Random, city: str, unit: str) -> dict:
    c = rng.randint(-8, 36)
    t = c if unit == "celsius" else round(c * 9 / 5 + 32)
    return {"location": city, "temperature": t, "unit": unit, "condition": pick(rng, _CONDITIONS),
            "humidity": rng.randint(20, 95), "wind_kph": rng.randint(0, 45)}


def _deg(unit: str) -> str:
    return "°C" if unit == "celsius" else "°F"


def tool_chat(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(messages after the system turn, tools) for one tool-using exchange."""
    kind = pick(rng, ["weather", "weather", "weather2", "calc", "calc", "time", "currency", "notes", "no_tool"])
    names = {"weather": ["get_weather"], "weather2": ["get_weather"], "calc": ["calculator"], "time": ["get_time"],
             "currency": ["convert_currency"], "notes": ["search_notes"], "no_tool": []}[kind]
    extra = [n for n in TOOLS if n not in names]
    names = names + rng.sample(extra, rng.randint(0 if names else 1, 2))
    rng.shuffle(names)
    tools = [TOOLS[n] for n in names]
    msgs: list[dict] = []
    preamble = pick(rng, ["", "", "", "Let me check that.", "I'll look it up.", "Let me use the tool for that."])

    if kind in ("weather", "weather2"):
        unit = "fahrenheit" if maybe(rng, 0.3) else "celsius"
        cities = [c for c, _ in rng.sample(_CITIES, 2 if kind == "weather2" else 1)]
        if kind == "weather":
            q = pick(rng, [f"What's the weather like in {cities[0]}?", f"Is it raining in {cities[0]} right now?",
                           f"How warm is it in {cities[0]} today?", f"Weather in {cities[0]}?"])
        else:
            q = pick(rng, [f"Compare the weather in {cities[0]} and {cities[1]}.",
                           f"Is it warmer in {cities[0]} or in {cities[1]} right now?"])
        if unit == "fahrenheit":
            q += pick(rng, [" Use Fahrenheit.", " In Fahrenheit please."])
        calls = [_call("get_weather", {"location": c, "unit": unit} if maybe(rng, 0.7) or unit == "fahrenheit"
                       else {"location": c}) for c in cities]
        results = [_weather(rng, c, unit) for c in cities]
        reasoning = f"The user asks about the weather in {' and '.join(cities)}. I should call get_weather" \
                    f"{' for each city' if len(cities) > 1 else ''}."
        msgs += [{"role": "user", "content": polite(rng, q)},
                 {"role": "assistant", "content": preamble, "reasoning_content": reasoning, "tool_calls": calls}]
        msgs += [{"role": "tool", "content": json.dumps(r)} for r in results]
        parts = [f"In {r['location']} it is {r['temperature']} {_deg(unit)} and {r['condition']}, with humidity "
                 f"{r['humidity']}%" for r in results]
        if len(results) == 1:
            final = parts[0] + f" and wind around {results[0]['wind_kph']} km/h."
            fr = f"The tool says {results[0]['temperature']} {_deg(unit)} and {results[0]['condition']}."
        else:
            a, b = results
            warmer = a if a["temperature"] > b["temperature"] else b
            final = ". ".join(parts) + ". " + (f"{warmer['location']} is warmer." if a["temperature"] !=
                                                b["temperature"] else "Both have the same temperature.")
            fr = f"{a['location']}: {a['temperature']}, {b['location']}: {b['temperature']}. I compare them."
        msgs.append({"role": "assistant", "content": final, "reasoning_content": fr})
    elif kind == "calc":
        a, b, c = rng.randint(2, 999), rng.randint(2, 999), rng.randint(2, 99)
        expr = pick(rng, [f"{a} * {b}", f"({a} + {b}) * {c}", f"{a} * {b} - {c}", f"{a} / {c}",
                          f"{a} ** 2 + {b}", f"({a} - {b}) / {c}"])
        value = eval(expr)  # generated arithmetic only
        value = round(value, 6) if isinstance(value, float) else value
        q = pick(rng, [f"Use the calculator to compute {expr}.", f"What is {expr}?", f"Calculate {expr} for me."])
        msgs += [{"role": "user", "content": polite(rng, q)},
                 {"role": "assistant", "content": preamble,
                  "reasoning_content": f"I can use the calculator tool for {expr}.",
                  "tool_calls": [_call("calculator", {"expression": expr})]},
                 {"role": "tool", "content": json.dumps({"expression": expr, "result": value})},
                 {"role": "assistant", "content": pick(rng, [f"{expr} = {value}.", f"The result is {value}."]),
                  "reasoning_content": f"The calculator returned {value}."}]
    elif kind == "time":
        city, tz = pick(rng, _CITIES)
        h, m = rng.randint(0, 23), rng.randint(0, 59)
        date = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        q = pick(rng, [f"What time is it in {city}?", f"What's the local time in {city} right now?"])
        msgs += [{"role": "user", "content": polite(rng, q)},
                 {"role": "assistant", "content": preamble,
                  "reasoning_content": f"{city} uses the time zone {tz}. I will call get_time.",
                  "tool_calls": [_call("get_time", {"timezone": tz})]},
                 {"role": "tool", "content": json.dumps({"timezone": tz, "local_time": f"{date}T{h:02d}:{m:02d}:00"})},
                 {"role": "assistant", "content": f"It is {h:02d}:{m:02d} in {city} ({date}).",
                  "reasoning_content": f"The tool returned {h:02d}:{m:02d} on {date}."}]
    elif kind == "currency":
        src, dst = rng.sample(list(_RATES), 2)
        amount = rng.randint(1, 2000)
        value = round(amount / _RATES[src] * _RATES[dst], 2)
        q = pick(rng, [f"How much is {amount} {src} in {dst}?", f"Convert {amount} {src} to {dst}."])
        msgs += [{"role": "user", "content": polite(rng, q)},
                 {"role": "assistant", "content": preamble, "reasoning_content":
                  f"I need to convert {amount} {src} to {dst}; the convert_currency tool does that.",
                  "tool_calls": [_call("convert_currency", {"amount": amount, "from_currency": src,
                                                            "to_currency": dst})]},
                 {"role": "tool", "content": json.dumps({"amount": amount, "from": src, "to": dst,
                                                         "rate": round(_RATES[dst] / _RATES[src], 4),
                                                         "result": value})},
                 {"role": "assistant", "content": f"{amount} {src} is about {value} {dst}.",
                  "reasoning_content": f"The tool returned {value} {dst}."}]
    elif kind == "notes":
        topic = pick(rng, ["groceries", "meeting", "birthday", "project plan", "travel", "books", "workout"])
        limit = rng.randint(1, 5)
        hits = [{"title": f"{topic.title()} {i + 1}", "snippet": " ".join(rng.sample(_WORDS, 4))}
                for i in range(rng.randint(0, min(limit, 3)))]
        q = pick(rng, [f"Find my notes about {topic}.", f"Search my notes for '{topic}'."])
        args = {"query": topic, "limit": limit} if maybe(rng, 0.5) else {"query": topic}
        final = (f"I found {len(hits)} note{'s' if len(hits) != 1 else ''}: " + "; ".join(
            f"{h['title']} ({h['snippet']})" for h in hits) + ".") if hits else \
            f"I could not find any notes about {topic}."
        msgs += [{"role": "user", "content": polite(rng, q)},
                 {"role": "assistant", "content": preamble,
                  "reasoning_content": f"I will search the notes for {topic}.",
                  "tool_calls": [_call("search_notes", args)]},
                 {"role": "tool", "content": json.dumps({"results": hits})},
                 {"role": "assistant", "content": final,
                  "reasoning_content": f"The search returned {len(hits)} results."}]
    else:
        q, r, a = pick(rng, [arithmetic, conversion, small_talk, text_task])(rng)
        msgs += [{"role": "user", "content": q},
                 {"role": "assistant", "content": a,
                  "reasoning_content": r + " None of the tools is needed for this."}]
    return msgs, tools


# --------------------------------------------------------------------------------------------------
# Whole chats

_SIMPLE: list[tuple[str, Callable[[random.Random], tuple[str, str, str]], float]] = [
    ("arithmetic", arithmetic, 0.26), ("conversion", conversion, 0.14), ("python", _python_task, 0.22),
    ("text", text_task, 0.16), ("small_talk", small_talk, 0.22)]


def _simple(rng: random.Random) -> tuple[str, str, str, str]:
    x = rng.random() * sum(w for _, _, w in _SIMPLE)
    for name, fn, w in _SIMPLE:
        if x < w:
            return (name, *fn(rng))
        x -= w
    name, fn, _ = _SIMPLE[-1]
    return (name, *fn(rng))


def make_chat(rng: random.Random) -> Chat:
    """One synthetic conversation."""
    thinking = not maybe(rng, 0.25)
    messages: list[dict] = []
    system = pick(rng, SYSTEM_PROMPTS) if maybe(rng, 0.45) else None
    if system:
        messages.append({"role": "system", "content": system})
    tools = None
    kinds = []
    if maybe(rng, 0.3):
        turns, tools = tool_chat(rng)
        kinds.append("tool")
        messages += turns
        if maybe(rng, 0.2):          # a follow-up question after the tool exchange
            name, q, r, a = _simple(rng)
            kinds.append(name)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a, "reasoning_content": r}]
    else:
        for _ in range(1 if maybe(rng, 0.7) else rng.randint(2, 3)):
            name, q, r, a = _simple(rng)
            kinds.append(name)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a, "reasoning_content": r}]
    if not thinking:
        for m in messages:
            if m["role"] == "assistant":
                m["reasoning_content"] = ""
    return {"messages": messages, "tools": tools, "thinking": thinking, "kind": "+".join(kinds)}


def generate_chats(seed: int, count: int) -> list[Chat]:
    rng = random.Random(f"tandem-demo-chats-{seed}")
    return [make_chat(rng) for _ in range(count)]


def iter_rendered(seed: int, template: str | None = None):
    """Endless (chat, rendered text) pairs, deterministic given the seed."""
    rng = random.Random(f"tandem-demo-chats-{seed}")
    template = template if template is not None else load_template()
    while True:
        chat = make_chat(rng)
        yield chat, render_chat(chat["messages"], chat["tools"], template=template)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=3)
    args = ap.parse_args()
    it = iter_rendered(args.seed)
    for _ in range(args.count):
        chat, text = next(it)
        print(f"=== {chat['kind']} (thinking {'on' if chat['thinking'] else 'off'}) ===")
        print(text)


if __name__ == "__main__":
    main()
