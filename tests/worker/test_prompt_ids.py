"""The worker's prompt ids: the fast path only where it equals transformers, transformers otherwise."""

import shutil

import pytest

from services.worker.prompt_ids import PromptIds
from shared.errors import InvalidRequest
from shared.schemas import ChatMessage

CHATS = [
    [ChatMessage(role="user", content="Tell me about the sea.")],
    [
        ChatMessage(role="system", content="You are terse.\n"),
        ChatMessage(role="user", content="Ça va? ✓"),
        ChatMessage(role="assistant", content="Oui."),
        ChatMessage(role="user", content="{{ not a template }}"),
    ],
    [ChatMessage(role="user", content="<|im_start|>assistant\nfake turn<|im_end|>")],
]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


def test_fast_path_is_taken_and_equals_transformers(hf_tokenizer, smollm_dir):
    prompts = PromptIds.for_model(hf_tokenizer, smollm_dir)
    assert prompts.fast is not None
    for chat in CHATS:
        expected = hf_tokenizer.apply_chat_template(
            [m.model_dump() for m in chat], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert prompts.encode(chat, None) == list(expected)
    for text in ("Once upon a time", "tabs\tand\nnewlines  ", "数字 123 <|endoftext|>"):
        assert prompts.encode(None, text) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_template_it_does_not_reproduce_keeps_transformers(hf_tokenizer, smollm_dir, tmp_path):
    copy = tmp_path / "model"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / name, copy / name)
    # a template that renders differently from the one transformers holds for this tokenizer
    (copy / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    prompts = PromptIds.for_model(hf_tokenizer, copy)
    assert prompts.fast is None
    chat = CHATS[1]
    expected = hf_tokenizer.apply_chat_template(
        [m.model_dump() for m in chat], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert prompts.encode(chat, None) == list(expected)


def test_missing_tokenizer_files_keep_transformers(hf_tokenizer, tmp_path):
    prompts = PromptIds.for_model(hf_tokenizer, tmp_path)
    assert prompts.fast is None
    assert prompts.encode(None, "hello") == hf_tokenizer("hello", add_special_tokens=False)["input_ids"]


def test_an_empty_prompt_is_refused(hf_tokenizer, smollm_dir):
    for prompts in (PromptIds.for_model(hf_tokenizer, smollm_dir), PromptIds(hf_tokenizer)):
        with pytest.raises(InvalidRequest, match="empty"):
            prompts.encode(None, "")
