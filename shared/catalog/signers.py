"""A trusted signer as the registry stores it in its signers bucket (``lf_signers``)."""

from shared.schemas import SignerRecord


def parse_signer(name: str, value: bytes) -> SignerRecord:
    """A signer as stored; one stored as a bare key (before tenant binding) may sign for no tenant
    until it is rotated with its tenants named."""
    text = value.decode()
    if text.startswith("{"):
        return SignerRecord.model_validate_json(text)
    return SignerRecord(signer=name, public_key=text.strip(), tenants=[])
