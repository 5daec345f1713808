"""Write ratchet_desk/items.json: the fixed dataset, generated once and shipped (nothing is
downloaded or generated at run time). Rerun only to change the dataset, then bump
`DeskSuite.declared_version`.

    python examples/desk-suite/make_items.py

Each subset has 24 train, 24 dev and 30 test items, a third each of weather, time zone and
currency requests, phrased in several ways so that a policy has to read the request (which
tool, which city, which amount and currencies) rather than learn one sentence. The backend's
values are made up but fixed: a help desk's fake services, not the world's weather.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# (city, UTC offset): real standard offsets; the weather is drawn from the seed below
CITIES = [
    (c.strip().rsplit(" ", 1)[0], c.strip().rsplit(" ", 1)[1])
    for c in """
Oslo UTC+1, Lima UTC-5, Cairo UTC+2, Hanoi UTC+7, Paris UTC+1, Seoul UTC+9, Rome UTC+1,
Nairobi UTC+3, Madrid UTC+1, Manila UTC+8, Zurich UTC+1, Perth UTC+8, Quito UTC-5,
Boston UTC-5, Denver UTC-7, Tokyo UTC+9, Berlin UTC+1, Lisbon UTC+0,
Dublin UTC+0, Athens UTC+2, Helsinki UTC+2, Warsaw UTC+1, Prague UTC+1, Vienna UTC+1,
Istanbul UTC+3, Moscow UTC+3, Dubai UTC+4, Karachi UTC+5, Delhi UTC+5:30, Dhaka UTC+6,
Bangkok UTC+7, Jakarta UTC+7, Singapore UTC+8, Beijing UTC+8, Taipei UTC+8, Sydney UTC+10,
Auckland UTC+12, Honolulu UTC-10, Anchorage UTC-9, Seattle UTC-8, Phoenix UTC-7, Chicago UTC-6,
Toronto UTC-5, Havana UTC-5, Bogota UTC-5, Caracas UTC-4, Santiago UTC-4, Montevideo UTC-3,
Accra UTC+0, Lagos UTC+1, Kinshasa UTC+1, Luanda UTC+1, Harare UTC+2, Addis Ababa UTC+3,
Riyadh UTC+3, Tehran UTC+3:30, Kabul UTC+4:30, Tashkent UTC+5, Kathmandu UTC+5:45,
Yangon UTC+6:30, Ulaanbaatar UTC+8, Osaka UTC+9, Brisbane UTC+10, Fiji UTC+12, New York UTC-5,
Los Angeles UTC-8, Mexico City UTC-6, Buenos Aires UTC-3, Sao Paulo UTC-3, Cape Town UTC+2,
Tel Aviv UTC+2, Kuala Lumpur UTC+8, Hong Kong UTC+8, San Juan UTC-4, Reykjavik UTC+0,
Edinburgh UTC+0, Marseille UTC+1, Munich UTC+1, Krakow UTC+1, Budapest UTC+1
""".replace("\n", " ").split(", ")
]
CONDITIONS = ["sunny", "cloudy", "rain", "snow", "windy", "fog", "storm", "clear"]
CODES = ["EUR", "USD", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK"]
PER_USD = {"EUR": 0.9, "USD": 1.0, "GBP": 0.8, "JPY": 150.0, "CHF": 0.88, "CAD": 1.35, "AUD": 1.5}
PER_USD["SEK"] = 10.5
AMOUNTS = [5, 10, 20, 25, 40, 50, 75, 100, 120, 150, 200, 250, 300, 500, 750, 1000]
SIZES = {"train": 24, "dev": 24, "test": 30}
ASK = {
    "weather": [
        "What is the weather in {c} right now?",
        "Is it raining in {c} today?",
        "How warm is it in {c} at the moment?",
        "Tell me the current weather for {c}.",
        "I am flying to {c} tonight: what is the weather there?",
    ],
    "timezone": [
        "Which time zone is {c} in?",
        "What is the UTC offset of {c}?",
        "What time zone does {c} use?",
        "I have a call with someone in {c}: which time zone are they in?",
    ],
    "currency": [
        "How much is {a} {s} in {t}?",
        "Convert {a} {s} to {t}.",
        "What is {a} {s} worth in {t}?",
        "I have {a} {s}: how many {t} is that?",
    ],
}


def slug(text: str) -> str:
    return "-".join(text.lower().split())


def main() -> None:
    rng = random.Random(20261204)
    cities = CITIES
    table = {
        c: {"weather": f"{rng.choice(CONDITIONS)}, {rng.randint(-10, 38)} C", "timezone": tz}
        for c, tz in cities
    }
    rates = [
        {"source": s, "target": t, "rate": round(PER_USD[t] / PER_USD[s], 4)}
        for s in CODES
        for t in CODES
        if s != t
    ]
    rate = {(r["source"], r["target"]): r["rate"] for r in rates}
    subsets: dict[str, list[dict]] = {}
    for subset in ("single", "multi"):
        items: list[dict] = []
        names = [c for c, _ in cities]
        for kind in ("weather", "timezone"):
            order = rng.sample(names, k=sum(SIZES.values()) // 3)
            start = 0
            for split, n in SIZES.items():
                for c in order[start : start + n // 3]:
                    request = rng.choice(ASK[kind]).format(c=c)
                    answer = table[c]["weather"].split(", ")[1] if kind == "weather" else table[c]["timezone"]
                    name = "get_weather" if kind == "weather" else "get_timezone"
                    items.append(
                        {
                            "id": f"{kind}-{slug(c)}",
                            "split": split,
                            "request": request,
                            "call": {"name": name, "args": {"city": c}},
                            "answer": answer,
                        }
                    )
                start += n // 3
        taken: set[tuple[int, str, str]] = set()
        for split, n in SIZES.items():
            for _ in range(n // 3):
                while True:
                    a, (s, t) = rng.choice(AMOUNTS), rng.sample(CODES, 2)
                    if (a, s, t) not in taken:
                        taken.add((a, s, t))
                        break
                request = rng.choice(ASK["currency"]).format(a=a, s=s, t=t)
                items.append(
                    {
                        "id": f"currency-{a}-{s.lower()}-{t.lower()}",
                        "split": split,
                        "request": request,
                        "call": {"name": "convert_currency", "args": {"amount": a, "source": s, "target": t}},
                        "answer": f"{a * rate[s, t]:.2f}",
                    }
                )
        order = {"train": 0, "dev": 1, "test": 2}
        items.sort(key=lambda i: (order[i["split"]], rng.random()))  # kinds interleaved within a split
        subsets[subset] = items
    data = {"cities": table, "rates": rates, "subsets": subsets}
    out = Path(__file__).parent / "ratchet_desk" / "items.json"
    out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}: " + ", ".join(f"{s} {len(v)} items" for s, v in subsets.items()))


if __name__ == "__main__":
    main()
