"""A submission's checks before the scheduler takes it: what only the platform may set is dropped."""

from services.scheduler.submission import parse_submission
from shared import subjects
from shared.bus import encode
from shared.schemas import RouteFacts
from tests.scheduler.test_grants import submission


def test_a_submission_claims_no_experiment_arm_and_a_direct_one_no_route_facts():
    claimed = submission("sum", experiment="ab", arm="treatment", route_facts=RouteFacts(key_id="0123456789abcdef"))
    direct = claimed.model_copy(update={"reply_to": "_INBOX_acme.r1"})
    request, preview = parse_submission(subjects.infer_submit("acme"), encode(direct))
    assert (request.experiment, request.arm, request.route_facts, preview) == (None, None, None, False)
    via_gateway = claimed.model_copy(update={"reply_to": "_INBOX.r1"})
    request, _ = parse_submission(subjects.infer_submit("acme", subjects.VIA_GATEWAY), encode(via_gateway))
    assert (request.experiment, request.arm) == (None, None)  # the scheduler's routing step assigns them
    assert request.route_facts is not None  # the gateway vouches for its own
