"""Write tasks.jsonl: unit conversion questions in several phrasings, with their answers.

Run once (`python make_tasks.py`); the seed is fixed, so the file is the same every time."""

from __future__ import annotations

import json
import random
from pathlib import Path

from units import SHORT, UNITS, plural

PHRASINGS = [
    "How many {to} are in {value} {frm}?",
    "Convert {value} {frm} to {to}.",
    "What is {value} {frm} in {to}?",
    "Express {value} {frm} in {to}.",
    "I have {value} {frm}. How much is that in {to}?",
]


def main(n: int = 150, seed: int = 7) -> None:
    rng = random.Random(seed)
    by_dim: dict[str, list[str]] = {}
    for unit, (dim, _) in UNITS.items():
        by_dim.setdefault(dim, []).append(unit)
    lines = []
    for i in range(n):
        dim = rng.choice(sorted(by_dim))
        frm, to = rng.sample(by_dim[dim], 2)
        value = rng.choice([rng.randint(2, 95), round(rng.uniform(1, 50), 1)])
        word = SHORT[frm] if frm in SHORT and rng.random() < 0.25 else plural(frm)
        question = rng.choice(PHRASINGS).format(value=value, frm=word, to=plural(to))
        answer = value * UNITS[frm][1] / UNITS[to][1]
        lines.append(json.dumps({"id": f"u{i:03d}", "input": question, "answer": answer}))
    Path(__file__).with_name("tasks.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
