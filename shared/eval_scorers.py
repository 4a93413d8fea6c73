"""Eval scorers: ``(answer, expected) -> score in [0, 1]``, looked up by the name an eval item carries.

Shared by the registry's platform-run release eval and the client-side harness (``lorafleet eval``)."""

import json
import re
import sqlite3
import time
from collections.abc import Callable

from shared.errors import InvalidRequest

Scorer = Callable[[str, str], float]

SQL_SCHEMA = "CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT, department TEXT, city TEXT, salary INTEGER)"
SQL_ROWS = (
    (1, "Alice", "Sales", "Paris", 52000), (2, "Bob", "Engineering", "Berlin", 81000),
    (3, "Chen", "Engineering", "Paris", 93000), (4, "Dana", "Marketing", "Madrid", 61000),
    (5, "Emil", "Finance", "Berlin", 72000), (6, "Fatima", "Sales", "Rome", 48000),
    (7, "Goran", "Support", "Madrid", 39000), (8, "Hana", "Finance", "Rome", 88000),
    (9, "Ivan", "Marketing", "Paris", 57000), (10, "Julia", "Support", "Berlin", 42000),
    (11, "Kofi", "Legal", "Vienna", 99000), (12, "Lena", "Legal", "Madrid", 76000),
)  # fmt: skip


SQL_DEADLINE_S = 1.0  # a query of the 12-row demo table answers in microseconds; model output may not end
SQL_MAX_ROWS = 10_000  # far above any answer over 12 rows; a cross join of the table with itself stops here
SQL_PROGRESS_STEPS = 1_000  # SQLite VM instructions between two deadline checks

_FENCE = re.compile(r"```[a-zA-Z]*\n?(.*?)```", re.DOTALL)


def unfence(text: str) -> str:
    """The body of the first markdown code block, or the text itself: a fenced answer is not penalised."""
    match = _FENCE.search(text)
    return match.group(1).strip() if match else text.strip()


def normalise(text: str) -> str:
    return " ".join(text.strip().rstrip(";").split()).lower()


def _query(sql: str, deadline_s: float = SQL_DEADLINE_S) -> list[tuple[object, ...]] | None:
    """Rows of ``sql`` on a fresh in-memory copy of the demo table (order-insensitive); None if it
    fails, runs past ``deadline_s`` (SQLite's progress handler interrupts it: a recursive CTE never
    ends) or returns more than ``SQL_MAX_ROWS`` rows."""
    db = sqlite3.connect(":memory:")
    try:
        db.execute(SQL_SCHEMA)
        db.executemany("INSERT INTO employees VALUES (?, ?, ?, ?, ?)", SQL_ROWS)
        deadline = time.monotonic() + deadline_s
        db.set_progress_handler(lambda: time.monotonic() > deadline, SQL_PROGRESS_STEPS)
        rows = db.execute(sql).fetchmany(SQL_MAX_ROWS + 1)
        return sorted(rows, key=repr) if len(rows) <= SQL_MAX_ROWS else None
    except sqlite3.Error:
        return None
    finally:
        db.close()


def sql_exec(answer: str, expected: str) -> float:
    """1 when the answer is one SELECT returning the same rows as the expected query."""
    answer = unfence(answer)
    if not normalise(answer).startswith("select") or ";" in answer.rstrip(";"):
        return 0.0
    want = _query(expected)
    return float(want is not None and _query(answer) == want)


def json_fields(answer: str, expected: str) -> float:
    """1 when the answer is exactly one JSON object equal to the expected one."""
    try:
        return float(json.loads(unfence(answer)) == json.loads(expected))
    except ValueError:
        return 0.0


_ANSWER = re.compile(r"^ANSWER: ([^\n]+)$")


def answer_format(answer: str, expected: str) -> float:
    """1 when the whole reply is ``ANSWER: <expected>`` (the value compared case-insensitively)."""
    match = _ANSWER.match(answer.strip())
    return float(match is not None and match.group(1).strip().rstrip(".").lower() == expected.lower())


def exact(answer: str, expected: str) -> float:
    return float(normalise(answer) == normalise(expected))


SCORERS: dict[str, Scorer] = {
    "sql_exec": sql_exec,
    "json_fields": json_fields,
    "answer_format": answer_format,
    "exact": exact,
}


def scorer(name: str) -> Scorer:
    try:
        return SCORERS[name]
    except KeyError:
        raise InvalidRequest(f"unknown scorer {name!r}; known: {sorted(SCORERS)}") from None
