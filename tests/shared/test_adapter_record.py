"""An adapter record's ``digest`` keeps its stored name: records written before the rename (and every
reader of the bucket or of the registry's replies) see "checksum"."""

import json

import pytest
from pydantic import ValidationError

from shared.bus import encode
from shared.schemas import AdapterRecord, AdapterRecordsReply
from tests.helpers.records import make_record

WEIGHTS = "ab" * 32


def test_the_digest_is_stored_and_sent_as_checksum() -> None:
    record = make_record("sea", 1, "acme").model_copy(update={"digest": WEIGHTS})
    stored = json.loads(record.model_dump_json())
    assert stored["checksum"] == WEIGHTS and "digest" not in stored
    assert record.model_dump()["checksum"] == WEIGHTS  # the CLI's --json output too
    reply = json.loads(encode(AdapterRecordsReply(records=[record])))  # the registry's replies
    assert reply["records"][0]["checksum"] == WEIGHTS


def test_a_record_stored_under_either_name_reads_back_the_same() -> None:
    record = make_record("sea", 1, "acme").model_copy(update={"digest": WEIGHTS})
    stored = json.loads(record.model_dump_json())
    assert AdapterRecord.model_validate_json(json.dumps(stored)) == record
    renamed = {("digest" if k == "checksum" else k): v for k, v in stored.items()}
    assert AdapterRecord.model_validate(renamed) == record


def test_a_record_without_a_digest_or_with_an_unknown_field_is_refused() -> None:
    stored = json.loads(make_record("sea", 1, "acme").model_dump_json())
    with pytest.raises(ValidationError):
        AdapterRecord.model_validate({k: v for k, v in stored.items() if k != "checksum"})
    with pytest.raises(ValidationError):
        AdapterRecord.model_validate({**stored, "digset": WEIGHTS})
