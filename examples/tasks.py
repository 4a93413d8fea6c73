"""The three demo tasks: seeded generators of (user prompt, expected answer) pairs, one scorer each."""

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from shared.eval_scorers import SQL_ROWS

Pair = tuple[str, str]

DEPARTMENTS = sorted({row[2] for row in SQL_ROWS})
CITIES = sorted({row[3] for row in SQL_ROWS})
SQL_TEMPLATES = (
    ("List the names of employees in the {d} department.", "SELECT name FROM employees WHERE department = '{d}';"),
    ("Show everyone who works in {c}.", "SELECT name FROM employees WHERE city = '{c}';"),
    ("How many employees are in {d}?", "SELECT COUNT(*) FROM employees WHERE department = '{d}';"),
    ("How many people work in {c}?", "SELECT COUNT(*) FROM employees WHERE city = '{c}';"),
    ("What is the average salary in {d}?", "SELECT AVG(salary) FROM employees WHERE department = '{d}';"),
    ("What is the highest salary in {c}?", "SELECT MAX(salary) FROM employees WHERE city = '{c}';"),
    ("Who earns more than {n}?", "SELECT name FROM employees WHERE salary > {n};"),
    ("Who earns less than {n}?", "SELECT name FROM employees WHERE salary < {n};"),
    ("Which employees in {c} work in {d}?",
     "SELECT name FROM employees WHERE city = '{c}' AND department = '{d}';"),
)  # fmt: skip

NAMES = (
    "Maria",
    "Tom",
    "Aisha",
    "Kenji",
    "Lucas",
    "Sofia",
    "Omar",
    "Ingrid",
    "Pedro",
    "Mei",
    "Noah",
    "Zara",
    "Ravi",
    "Elena",
    "Jonas",
    "Amara",
    "Felix",
    "Yuki",
    "Leila",
    "Marco",
    "Nadia",
    "Oscar",
    "Priya",
    "Sven",
)
TOWNS = (
    "Lisbon",
    "Oslo",
    "Toronto",
    "Nairobi",
    "Lima",
    "Dublin",
    "Prague",
    "Seoul",
    "Cairo",
    "Denver",
    "Hamburg",
    "Osaka",
    "Quito",
    "Athens",
    "Krakow",
    "Austin",
    "Porto",
    "Zurich",
    "Hanoi",
    "Perth",
)
PERSON_TEMPLATES = (
    "{name} is {age} years old and lives in {city}.",
    "Meet {name}, a {age}-year-old from {city}.",
    "{name} ({age}) moved to {city} last year.",
    "At {age}, {name} runs a small shop in {city}.",
    "Our new colleague {name} is {age} and comes from {city}.",
)

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Greece": "Athens", "Portugal": "Lisbon",
    "Austria": "Vienna", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen",
    "Poland": "Warsaw", "Ireland": "Dublin", "Belgium": "Brussels", "Netherlands": "Amsterdam", "Peru": "Lima",
    "Hungary": "Budapest", "Thailand": "Bangkok", "Kenya": "Nairobi", "Mexico": "Mexico City", "Cuba": "Havana",
    "England": "London", "Argentina": "Buenos Aires", "Chile": "Santiago", "Colombia": "Bogota", "Iran": "Tehran",
    "Iraq": "Baghdad", "South Korea": "Seoul", "Indonesia": "Jakarta", "Philippines": "Manila", "Turkey": "Ankara",
    "Vietnam": "Hanoi", "Ukraine": "Kyiv", "Czech Republic": "Prague", "Canada": "Ottawa", "Australia": "Canberra",
}  # fmt: skip
CAPITAL_TEMPLATES = (
    "What is the capital of {x}?",
    "Which city is the capital of {x}?",
    "Name the capital of {x}.",
    "What's the capital city of {x}?",
)


def sql_pair(rng: random.Random) -> Pair:
    question, sql = rng.choice(SQL_TEMPLATES)
    values = {"d": rng.choice(DEPARTMENTS), "c": rng.choice(CITIES), "n": rng.randrange(35, 100) * 1000}
    return f"Write SQL for: {question.format(**values)}", sql.format(**values)


def json_pair(rng: random.Random) -> Pair:
    person = {"name": rng.choice(NAMES), "age": rng.randrange(18, 80), "city": rng.choice(TOWNS)}
    sentence = rng.choice(PERSON_TEMPLATES).format(**person)
    return f"Extract name, age and city as JSON: {sentence}", json.dumps(person)


def capital_pair(rng: random.Random, countries: list[str]) -> Pair:
    country = rng.choice(countries)
    return rng.choice(CAPITAL_TEMPLATES).format(x=country), f"ANSWER: {CAPITALS[country]}"


@dataclass(frozen=True, slots=True)
class Task:
    name: str
    scorer: str
    threshold: float
    train: Callable[[random.Random], Pair]
    held_out: Callable[[random.Random], Pair]
    expected: Callable[[str], str] = lambda answer: answer  # what the scorer compares to


# capitals: whole countries are held out, so the eval set asks about places training never named
_EVAL_COUNTRIES = sorted(CAPITALS)[::4]
_TRAIN_COUNTRIES = [c for c in sorted(CAPITALS) if c not in _EVAL_COUNTRIES]

TASKS = {
    "sql-employees": Task("sql-employees", "sql_exec", 0.6, sql_pair, sql_pair),
    "json-extract": Task("json-extract", "json_fields", 0.6, json_pair, json_pair),
    "capital-answer": Task("capital-answer", "answer_format", 0.4,
                           lambda rng: capital_pair(rng, _TRAIN_COUNTRIES),
                           lambda rng: capital_pair(rng, _EVAL_COUNTRIES),
                           lambda answer: answer.removeprefix("ANSWER: ")),
}  # fmt: skip
