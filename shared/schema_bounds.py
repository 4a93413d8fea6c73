"""The shape bounds of a JSON schema a client sends (response_format, a tool's parameters): checked
before anything walks the schema recursively (the meta-schema check, the grammar compiler), so a
deep or huge schema is a typed 400 instead of a RecursionError."""

import json
from typing import Any

from shared.errors import InvalidSchema, SchemaTooLarge


def check_schema_shape(schema: Any, max_depth: int, max_values: int, param: str) -> None:
    """Raise SchemaTooLarge when ``schema`` nests objects and arrays deeper than ``max_depth`` or holds
    more than ``max_values`` JSON values; walks without recursion."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    values = 0
    while stack:
        value, depth = stack.pop()
        values += 1
        if values > max_values:
            raise SchemaTooLarge(f"the JSON schema holds more than {max_values} values", param=param)
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for child in children:
            if isinstance(child, dict | list) and depth + 1 > max_depth:
                raise SchemaTooLarge(f"the JSON schema nests deeper than {max_depth} levels", param=param)
            stack.append((child, depth + 1))


def parse_schema_text(text: str, max_depth: int, max_values: int, param: str) -> Any:
    """A schema sent as JSON text (a direct-NATS submission's), parsed and held to the same bounds."""
    try:
        schema = json.loads(text)
    except RecursionError:
        raise SchemaTooLarge(f"the JSON schema nests deeper than {max_depth} levels", param=param) from None
    except ValueError as e:
        raise InvalidSchema(f"the JSON schema is not JSON: {e}", param=param) from None
    check_schema_shape(schema, max_depth, max_values, param)
    return schema
