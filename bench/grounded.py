"""Input-grounded prompts: tasks whose answer copies long spans of the prompt (edit,
rename, extract, convert, repeat), the work prompt-lookup speculation is for.

Each prompt is a completion-style instruction over a source of a few hundred tokens, so
any OpenAI-compatible server can run it on `/v1/completions`. Prompts are distinct (the
sources, tasks and the names a task uses vary with the index) and the same for a seed.
"""

from __future__ import annotations

import random

CODE = '''def total_price(items, tax_rate, discount=None):
    """Return the price of `items` with tax, less an optional discount."""
    subtotal = 0
    for item in items:
        if item.quantity <= 0:
            raise ValueError(f"bad quantity for {item.name}: {item.quantity}")
        subtotal += item.price * item.quantity
    if discount is not None:
        subtotal -= discount.amount(subtotal)
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)


def average_price(items):
    """The mean unit price of `items`, 0 for none."""
    if not items:
        return 0
    return sum(item.price for item in items) / len(items)


class Cart:
    def __init__(self, owner):
        self.owner = owner
        self.items = []

    def add(self, item):
        self.items.append(item)
        return len(self.items)

    def total(self, tax_rate):
        return total_price(self.items, tax_rate)
'''

PROSE = (
    "The city library opens at nine in the morning and closes at six in the evening from "
    "Monday to Friday. On Saturdays it opens at ten and closes at four, and on Sundays it "
    "stays closed. Visitors may borrow up to five books at a time, for three weeks, and may "
    "renew each loan twice unless another reader has reserved the book. Late returns cost "
    "twenty cents a day per book. The reading room on the second floor is quiet and has "
    "forty desks with power outlets. Children under twelve must be accompanied by an adult "
    "in the reading room. The library also lends laptops for use inside the building; ask "
    "at the front desk and bring a photo identity card. Group study rooms can be booked up "
    "to a week in advance on the library's website."
)

TYPOS = {
    "morning": "mornign",
    "evening": "evenign",
    "Saturdays": "Saturdyas",
    "borrow": "borow",
    "reserved": "reserverd",
    "quiet": "quite",
    "accompanied": "acompanied",
    "building": "buliding",
    "website": "websit",
}

JSON_SOURCE = """{
  "service": "inventory",
  "version": "2.4.1",
  "port": 8080,
  "debug": false,
  "database": {
    "host": "db.internal",
    "port": 5432,
    "name": "inventory",
    "pool_size": 20,
    "timeout_seconds": 30
  },
  "cache": {
    "enabled": true,
    "backend": "redis",
    "ttl_seconds": 600
  },
  "features": ["search", "export", "audit_log", "bulk_import"],
  "owners": [
    {"name": "Ana Ruiz", "email": "ana@example.com", "role": "lead"},
    {"name": "Tom Berg", "email": "tom@example.com", "role": "on-call"}
  ]
}"""

CSV_SOURCE = """city,country,population,area_km2,founded
Lisbon,Portugal,545000,100,1147
Porto,Portugal,232000,41,1123
Madrid,Spain,3305000,604,865
Seville,Spain,684000,140,1248
Lyon,France,522000,48,1312
Bordeaux,France,260000,49,1154
Turin,Italy,848000,130,1280
Bologna,Italy,392000,140,1088"""

NAMES = ["subtotal", "items", "item", "discount", "tax_rate", "owner"]
NEW_NAMES = ["net", "products", "product", "rebate", "vat_rate", "customer", "line", "rate"]
WORDS = ["book", "rooms", "adult", "laptops", "Sundays", "loan", "desks", "cents"]


def _misspelt(rng: random.Random) -> str:
    text = PROSE
    for right, wrong in rng.sample(sorted(TYPOS.items()), 5):
        text = text.replace(right, wrong, 1)
    return text


def _task(kind: int, rng: random.Random) -> tuple[str, str]:
    """(instruction, source) of task `kind` (0..7), its names drawn from `rng`."""
    if kind == 0:
        old, new = rng.choice(NAMES), rng.choice(NEW_NAMES)
        return f"Rename `{old}` to `{new}` everywhere in this Python code.", CODE
    if kind == 1:
        return "Add Python type hints to every function of this code; change nothing else.", CODE
    if kind == 2:
        return "Correct the spelling mistakes in this text; change nothing else.", _misspelt(rng)
    if kind == 3:
        word = rng.choice(WORDS)
        return f"Copy, word for word, every sentence of this text that mentions {word}.", PROSE
    if kind == 4:
        return "Convert this JSON document to YAML.", JSON_SOURCE
    if kind == 5:
        return "Convert this CSV table to a Markdown table.", CSV_SOURCE
    if kind == 6:
        return "Convert this CSV table to a JSON list of objects.", CSV_SOURCE
    return "Repeat this text exactly.", rng.choice([PROSE, CODE])


NUM_KINDS = 8


def grounded_prompts(count: int, seed: int) -> list[str]:
    """`count` distinct prompts cycling through the task kinds, the same for a seed."""
    rng = random.Random(seed)
    prompts: list[str] = []
    for index in range(count):
        instruction, source = _task(index % NUM_KINDS, rng)
        prompts.append(f"Task {index + 1}. {instruction}\n\n### Input\n{source}\n\n### Output\n")
    return prompts
