"""Scorers: right answers score 1, near misses 0, fenced answers are not penalised."""

import threading

import pytest

from shared.errors import InvalidRequest
from shared.eval_scorers import SQL_DEADLINE_S, answer_format, exact, json_fields, scorer, sql_exec

SQL = "SELECT name FROM employees WHERE department = 'Legal';"


def test_sql_scores_by_result_not_text() -> None:
    assert sql_exec(SQL, SQL) == 1.0
    assert sql_exec("select NAME from employees where department='Legal'", SQL) == 1.0
    assert sql_exec("SELECT name FROM employees WHERE city = 'Vienna' OR name = 'Lena'", SQL) == 1.0
    assert sql_exec("```sql\nSELECT name FROM employees WHERE department = 'Legal';\n```", SQL) == 1.0


@pytest.mark.parametrize("answer", [
    "SELECT name FROM employees WHERE department = 'Sales';",
    "SELECT name FROM staff WHERE department = 'Legal';",
    "Here is the query: SELECT name FROM employees",
    "SELECT name FROM employees WHERE department = 'Legal'; DROP TABLE employees;",
    "",
])  # fmt: skip
def test_sql_refuses_wrong_broken_or_chained_queries(answer: str) -> None:
    assert sql_exec(answer, SQL) == 0.0


def test_json_needs_exactly_the_expected_object() -> None:
    expected = '{"name": "Mei", "age": 31, "city": "Oslo"}'
    assert json_fields('{"city":"Oslo","name":"Mei","age":31}', expected) == 1.0
    assert json_fields('```json\n{"name": "Mei", "age": 31, "city": "Oslo"}\n```', expected) == 1.0
    assert json_fields('{"name": "Mei", "age": "31", "city": "Oslo"}', expected) == 0.0
    assert json_fields('{"name": "Mei", "age": 31}', expected) == 0.0
    assert json_fields("Mei is 31 and lives in Oslo.", expected) == 0.0


def test_answer_format_needs_the_form_and_the_value() -> None:
    assert answer_format("ANSWER: Paris", "Paris") == 1.0
    assert answer_format("ANSWER: paris.", "Paris") == 1.0
    assert answer_format("The capital of France is Paris.", "Paris") == 0.0
    assert answer_format("ANSWER: Lyon", "Paris") == 0.0
    assert answer_format("ANSWER: Paris\nIt is a lovely city.", "Paris") == 0.0


def test_exact_and_lookup() -> None:
    assert exact("  Hello   World ", "hello world") == 1.0
    assert scorer("sql_exec") is sql_exec
    with pytest.raises(InvalidRequest, match="unknown scorer"):
        scorer("vibes")


ENDLESS = "SELECT x FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c WHERE x < 0)"
HUGE = "SELECT a.id FROM employees a, employees b, employees c, employees d, employees e"


@pytest.mark.parametrize("answer", [ENDLESS, HUGE], ids=["recursive-cte", "cross-join"])
def test_sql_that_never_ends_or_never_stops_returning_scores_zero_within_the_deadline(answer: str) -> None:
    """A recursive CTE with no end ran forever (eval and canary hung); it is interrupted at the deadline."""
    scores: list[float] = []
    scoring = threading.Thread(target=lambda: scores.append(sql_exec(answer, SQL)), daemon=True)  # a hang stays behind
    scoring.start()
    scoring.join(SQL_DEADLINE_S + 10)  # generous: a slow machine still ends; a hang never does
    assert scores == [0.0]
