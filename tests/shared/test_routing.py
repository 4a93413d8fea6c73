"""Task routes and routing policies: the one evaluator (``first_match``), the routing step before
resolution (``Routes.route``), and a submission granted through it as the gateway and the scheduler
grant it (``Grants`` over a ``CatalogView`` that follows the routing bucket)."""

import pytest

from shared.catalog.grants import Grants
from shared.catalog.policy import RequestFacts, first_match
from shared.catalog.resolve import to_resolved
from shared.catalog.routing import Routes, policies_key, tasks_key
from shared.catalog.view import CatalogView
from shared.errors import InvalidRequest, RoutePolicyRefused, TaskNotFound
from shared.kv_follow import Position
from shared.schemas import InferRequest, PolicyRule, RouteFacts, RoutePolicies, TaskRoutes
from tests.scheduler.test_grants import BASE, PROD, RECORDS, SHARED_V1, Registry, submission

KEY = "0123456789abcdef"
OTHER_KEY = "fedcba9876543210"


def rule(name: str, target: dict, **match) -> PolicyRule:
    return PolicyRule.model_validate({"name": name, "match": match, "target": target})


def routes(
    tasks: dict[str, dict] | None = None, rules: list[PolicyRule] = (), platform: list[PolicyRule] = ()
) -> Routes:
    state = Routes()
    if tasks is not None:
        table = TaskRoutes(tenant_id="acme", routes=tasks, revision=1)
        state.apply(tasks_key("acme"), table.model_dump_json().encode(), 1)
    if rules:
        state.apply(
            policies_key("acme"), RoutePolicies(tenant_id="acme", rules=list(rules)).model_dump_json().encode(), 2
        )
    if platform:
        state.apply(policies_key(None), RoutePolicies(rules=list(platform)).model_dump_json().encode(), 3)
    return state


def test_the_first_matching_rule_wins_and_every_given_field_must_hold():
    rules = [
        rule("gold-sql", {"kind": "task", "task": "sql"}, tier="interactive", metadata={"team": "bi"}),
        rule("by-key", {"kind": "adapter", "adapter": {"adapter": "acme-sum", "version": 1}}, key_id=KEY),
        rule("beta", {"kind": "refuse", "message": "beta closed"}, header={"name": "x-beta", "value": "1"}),
    ]
    assert first_match(rules, RequestFacts(tier="interactive", metadata={"team": "bi"})).name == "gold-sql"
    assert first_match(rules, RequestFacts(tier="interactive", metadata={"team": "ops"}, key_id=KEY)).name == "by-key"
    assert first_match(rules, RequestFacts(key_id=OTHER_KEY, headers={"x-beta": "1"})).name == "beta"
    assert first_match(rules, RequestFacts(key_id=OTHER_KEY, headers={"x-beta": "2"})) is None
    assert first_match([rule("all", {"kind": "refuse"})], RequestFacts()).name == "all"  # no field: every request


def test_a_task_is_served_by_the_route_its_table_names_in_both_forms():
    state = routes({"text_to_sql": {"adapter": "sum"}, "pinned": {"adapter": "acme-sum", "version": 1}})
    assert state.route("acme", "task:text_to_sql", None, RequestFacts()).model == "sum"
    assert state.route("acme", "auto", "text_to_sql", RequestFacts()).task == "text_to_sql"
    assert state.route("acme", "task:pinned", None, RequestFacts()).model == "acme-sum@1"
    assert state.route("acme", "acme-sum", "text_to_sql", RequestFacts()).model == "acme-sum"  # header only with auto
    with pytest.raises(InvalidRequest):
        state.route("acme", "auto", None, RequestFacts())
    with pytest.raises(InvalidRequest):
        state.route("acme", "task:Bad Name", None, RequestFacts())


def test_a_missing_task_lists_only_the_tenants_own_tasks_and_visible_models():
    state = routes({"text_to_sql": {"adapter": "sum"}})
    other = TaskRoutes(tenant_id="other", routes={"secret_task": {"adapter": "other-secret"}})
    state.apply(tasks_key("other"), other.model_dump_json().encode(), 9)
    with pytest.raises(TaskNotFound) as refused:
        state.route("acme", "task:nope", None, RequestFacts(), lambda: ["tiny-llama", "acme-sum"])
    assert refused.value.status == 404
    assert "task:text_to_sql" in refused.value.message and "acme-sum" in refused.value.message
    assert "secret" not in refused.value.message and "other" not in refused.value.message


def test_platform_rules_come_before_the_tenants_and_a_refusal_is_typed():
    state = routes(
        {"sql": {"adapter": "sum"}},
        rules=[rule("key-to-task", {"kind": "task", "task": "sql"}, key_id=KEY)],
        platform=[rule("freeze", {"kind": "refuse", "message": "frozen"}, metadata={"freeze": "yes"})],
    )
    routed = state.route("acme", "tiny-llama", None, RequestFacts(key_id=KEY))
    assert (routed.model, routed.task, routed.rule, routed.scope) == ("sum", "sql", "key-to-task", "tenant")
    with pytest.raises(RoutePolicyRefused) as refused:
        state.route("acme", "tiny-llama", None, RequestFacts(key_id=KEY, metadata={"freeze": "yes"}))
    assert (refused.value.status, refused.value.rule, refused.value.scope) == (403, "freeze", "platform")
    assert state.route("globex", "x", None, RequestFacts(key_id=KEY)).model == "x"  # acme's rules are acme's


def test_a_deleted_table_routes_nothing():
    state = routes({"sql": {"adapter": "sum"}})
    state.apply(tasks_key("acme"), None, 5)
    with pytest.raises(TaskNotFound):
        state.route("acme", "task:sql", None, RequestFacts())


def routing_view(state: Routes) -> CatalogView:
    view = CatalogView(Registry(*RECORDS))
    for revision, record in enumerate(RECORDS, start=1):
        view.apply(f"{record.adapter_id}.{record.version}", record.model_dump_json().encode(), revision)
    view.mark_loaded()
    view.base_model = BASE
    view.routes = state
    view.routing_position = Position("lf_routing")
    return view


async def test_the_scheduler_grants_a_task_and_a_key_rule_as_the_gateway_routed_them():
    state = routes(
        {"sql": {"adapter": "sum"}, "chat": {"adapter": "shared-chat"}},
        rules=[rule("by-key", {"kind": "task", "task": "chat"}, key_id=KEY)],
    )
    view = routing_view(state)
    grants = Grants(view.resolve, view.catalog, view.route)
    sql = await grants.grant(submission("task:sql", request_key="u1"), preview=False)
    assert (sql.model, sql.task, sql.adapter) == ("sum", "sql", to_resolved(PROD))
    keyed = submission("task:sql", route_facts=RouteFacts(key_id=KEY))
    chat = await grants.grant(keyed, preview=False)
    assert (chat.task, chat.adapter) == ("chat", to_resolved(SHARED_V1))
    with pytest.raises(TaskNotFound):
        await grants.grant(submission("auto", task="nope"), preview=False)


async def test_a_view_without_the_routing_bucket_checks_a_routed_request_as_it_stands():
    view = routing_view(Routes())
    view.routing_position = None  # a worker's view
    granted = await view.grant(submission("sum", task="sql"), preview=False)
    assert (granted.model, granted.task, granted.adapter) == ("sum", "sql", to_resolved(PROD))


def test_request_inputs_are_bounded():
    with pytest.raises(ValueError):
        submission("x", metadata={f"k{i}": "v" for i in range(17)})
    with pytest.raises(ValueError):
        submission("x", metadata={"bad key": "v"})
    with pytest.raises(ValueError):
        RouteFacts(headers={"authorization": "secret"})
    with pytest.raises(ValueError):
        rule("two", {"kind": "adapter", "task": "sql"})
    with pytest.raises(ValueError):
        RoutePolicies(rules=[rule("a", {"kind": "refuse"}), rule("a", {"kind": "refuse"})])
    with pytest.raises(ValueError):
        TaskRoutes(tenant_id="acme", routes={"Bad": {"adapter": "x"}})
    assert isinstance(submission("x", metadata={"team": "bi"}), InferRequest)
