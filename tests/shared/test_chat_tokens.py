"""shared.chat_tokens: template errors and missing templates are typed 400s, not crashes."""

import pytest
from tokenizers import Tokenizer

from shared.chat_tokens import ChatTokenizer
from shared.errors import InvalidRequest
from shared.schemas import ChatMessage


@pytest.fixture(scope="module")
def tokenizer(smollm_dir) -> Tokenizer:
    return Tokenizer.from_file(str(smollm_dir / "tokenizer.json"))


def test_a_template_raising_is_an_invalid_request(tokenizer):
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}x"
    chat = ChatTokenizer(tokenizer, template, {})
    assert (
        chat.encode([ChatMessage(role="user", content="hi")], None)
        == tokenizer.encode("x", add_special_tokens=False).ids
    )
    with pytest.raises(InvalidRequest, match="first message must be user"):
        chat.encode([ChatMessage(role="system", content="hi")], None)


def test_no_chat_template_refuses_chats_but_encodes_prompts(tokenizer):
    chat = ChatTokenizer(tokenizer, None, {})
    with pytest.raises(InvalidRequest, match="no chat template"):
        chat.encode([ChatMessage(role="user", content="hi")], None)
    assert chat.encode(None, "hi there") == tokenizer.encode("hi there", add_special_tokens=False).ids


def test_template_helpers_match_transformers(tokenizer):
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
        "{{ bos_token }}"
    )
    chat = ChatTokenizer(tokenizer, template, {"bos_token": "<|im_start|>"})
    text = '{"role": "user", "content": "é"}<|im_start|>'
    assert (
        chat.encode([ChatMessage(role="user", content="é"), ChatMessage(role="user", content="b")], None)
        == tokenizer.encode(text, add_special_tokens=False).ids
    )
