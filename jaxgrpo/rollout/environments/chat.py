"""Token accounting of a multi-turn conversation: the policy's tokens as sampled, the environment's
text tokenised in the chat template's own wrapping.

A trajectory is ``prompt ‖ turn_1 ‖ obs_1 ‖ turn_2 ‖ obs_2 ‖ … ‖ turn_K`` where

- ``prompt``: ``apply_chat_template(reset messages, tools=env.tools, add_generation_prompt=True)``,
  tokenised once (:meth:`ChatFormat.prompt_ids`);
- ``turn_k``: the token ids the policy sampled, kept exactly (never decoded and re-encoded), ending
  with an end-of-turn id (EOS such as ``<|im_end|>``, or the tool-call end tag when the rollout stops
  there) or cut by the token budget;
- ``obs_k``: :meth:`ChatFormat.observation_ids` — what the chat template writes between the end of
  the policy's turn and the start of its next one: the close of the assistant turn when the policy
  stopped before writing it, the environment's messages in their roles (``tool``: for Qwen,
  ``<|im_start|>user\\n<tool_response>…</tool_response><|im_end|>``), then the generation prompt of
  the next assistant turn.

``observation_ids`` renders the conversation ``[user "·", assistant SENTINEL, *messages]`` with the
generation prompt and keeps the text after SENTINEL; if the policy's turn already ended with the
text that follows an assistant message in the template (e.g. ``<|im_end|>``), that much is dropped, so
the policy's own end tokens are not written twice. Only this text is tokenised
(``add_special_tokens=False``): a template whose rendering depends on earlier turns beyond this
(e.g. one that strips earlier reasoning) is rendered here as if the policy's turn were plain text.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["ChatFormat"]

_SENTINEL = "\x00JAXGRPO_TURN\x00"


class ChatFormat:
  """Renders prompts and observations of a tokenizer's chat template as token ids.

  Args:
    tokenizer: a ``transformers`` tokenizer with a ``chat_template``.
    tools: tool schemas (or functions) for the template's ``tools=``; None or empty: none.
  """

  def __init__(self, tokenizer, tools: Sequence[Any] | None = None):
    if getattr(tokenizer, "chat_template", None) is None:
      raise ValueError("ChatFormat needs a tokenizer with a chat_template (tokenizer.chat_template is None)")
    self.tokenizer = tokenizer
    self.tools = list(tools) if tools else None

  def _render(self, messages, *, generation_prompt: bool) -> str:
    return self.tokenizer.apply_chat_template(
      list(messages), tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
    )

  def encode(self, text: str) -> list[int]:
    """``text`` as ids, no special tokens added (special-token strings in it map to their ids)."""
    return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

  def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The prompt: ``messages`` with the tools and the generation prompt, as ids."""
    return self.encode(self._render(messages, generation_prompt=True))

  def observation_text(self, messages: Sequence[Mapping[str, Any]], turn_end: str = "") -> str:
    """The template's text between a policy turn ending in ``turn_end`` and the next policy turn."""
    head = [{"role": "user", "content": "·"}, {"role": "assistant", "content": _SENTINEL}]
    full = self._render(head + list(messages), generation_prompt=True)
    closed = self._render(head, generation_prompt=False)
    at = full.index(_SENTINEL) + len(_SENTINEL)
    after = closed[closed.index(_SENTINEL) + len(_SENTINEL) :]  # what closes an assistant message
    text = full[at:]
    # drop what the policy already wrote of the closing text (its EOS), longest match first
    for k in range(min(len(turn_end), len(after)), 0, -1):
      if turn_end.endswith(after[:k]) and text.startswith(after[:k]):
        return text[k:]
    return text

  def observation_ids(self, messages: Sequence[Mapping[str, Any]], last_ids: Sequence[int] = ()) -> list[int]:
    """:meth:`observation_text` as ids, for a policy turn whose last ids are ``last_ids``."""
    turn_end = self.tokenizer.decode(list(last_ids)[-4:], skip_special_tokens=False) if len(last_ids) else ""
    return self.encode(self.observation_text(messages, turn_end))
