"""The gateway's torch-free token count equals the worker's (transformers' tokenizer + chat template)."""

from shared.prompt_tokens import PromptTokens
from shared.schemas import ChatMessage

CHATS = [
    [ChatMessage(role="user", content="What is the capital of France?")],
    [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="héllo  wörld\n\ttabs"),
        ChatMessage(role="assistant", content="Hi!"),
        ChatMessage(role="user", content="emoji 🦊 and <|im_end|>"),
    ],
]


def test_counts_match_transformers(smollm_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(smollm_dir)
    counter = PromptTokens.load(smollm_dir)
    for chat in CHATS:
        ids = reference.apply_chat_template(
            [m.model_dump() for m in chat], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert counter.count_sync(chat, None) == len(ids)
    for prompt in ("The capital of France is", "  spaces and ünïcode 🦊", "x" * 3000):
        assert counter.count_sync(None, prompt) == len(reference(prompt, add_special_tokens=False)["input_ids"])
