"""Conversations to prompts through the tokenizer's chat template."""

from __future__ import annotations

from .errors import CompiledSpecError

ROLES = ("system", "user", "assistant", "developer", "tool")


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """The prompt text for `messages`, ending where the assistant's answer begins."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise CompiledSpecError("this model has no chat template; send plain prompts (completions) instead",
                                param="messages")
    if not isinstance(messages, list) or not messages:
        raise CompiledSpecError("messages must be a non-empty list of {'role', 'content'} objects", param="messages")
    for number, message in enumerate(messages):
        well_formed = isinstance(message, dict) and isinstance(message.get("content"), str)
        if not well_formed or message.get("role") not in ROLES:
            raise CompiledSpecError(
                f"messages[{number}] must have a role ({', '.join(ROLES)}) and text content, got {message!r}",
                param=f"messages.{number}",
            )
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as error:  # templates raise on conversations they reject (e.g. roles out of order)
        raise CompiledSpecError(f"the model's chat template rejected these messages: {error}",
                                param="messages") from None
