"""A conversation as every chat-shaped API hands it over, in one form: its turns, the tools it offers and how the
reply may use them. Chat Completions and Anthropic's Messages each say theirs in their own shapes (server/schemas.py,
server/messages_schemas.py); from here on they are one: one rendering for the chat template, one grammar for
enforced calls, one reading of the calls in the generated text (server/tool_calls.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling import InvalidParameter
from server import reasoning, tool_calls

# The chat template's own variables, which a request's chat_template_kwargs may not replace.
TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


@dataclass(frozen=True)
class Turn:
    """One message: its role (system, user, assistant or tool), its text, an assistant turn's calls (OpenAI's
    tool_calls entries, arguments as JSON text) and a tool turn's call id."""

    role: str
    content: str
    calls: tuple[dict, ...] = ()
    call_id: str | None = None

    def __post_init__(self):
        if self.role not in ("system", "user", "assistant", "tool"):
            raise InvalidParameter(f"a turn's role is system, user, assistant or tool, not {self.role!r}")


@dataclass(frozen=True)
class Conversation:
    """The turns and the tools (OpenAI's function tool objects). tool_choice: "auto", "none", "required" or the
    name of the one function to call; parallel: whether a forced reply may make several calls."""

    turns: tuple[Turn, ...]
    tools: tuple[dict, ...] = ()
    tool_choice: str = "auto"
    parallel: bool = True
    # How this model writes calls (tool_calls.PARSERS) and its reasoning (reasoning.PARSERS): the server's choice
    # for the model, not the client's.
    tool_format: str = field(default="hermes", compare=False)
    reasoning_format: str = field(default="none", compare=False)
    # More of the chat template's variables (chat_template_kwargs: enable_thinking, ...).
    template_variables: dict = field(default_factory=dict, compare=False)
    reasoning_budget: int | None = None  # tokens the reasoning may take (Anthropic's budget_tokens), at most

    def __post_init__(self):
        if not self.turns:
            raise InvalidParameter("the conversation has no messages")
        names = [t["function"]["name"] for t in self.tools]
        if len(set(names)) < len(names):
            raise InvalidParameter("two tools have the same name")
        if self.tool_choice == "required" and not names:
            raise InvalidParameter("a reply that must call a tool needs tools")
        if reserved := [k for k in self.template_variables if k in TEMPLATE_OWN]:
            raise InvalidParameter(f"chat_template_kwargs may not set the template's own {', '.join(reserved)}")
        if self.forced_function is not None and self.forced_function not in names:
            raise InvalidParameter(f"the tool choice names the function {self.forced_function!r}, which is not among "
                                   f"the tools ({', '.join(map(repr, names)) or 'none given'})")

    @property
    def calls_tools(self) -> bool:
        """Whether the reply is read for tool calls: tools offered, and the choice not "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_function(self) -> str | None:
        return None if self.tool_choice in ("auto", "none", "required") else self.tool_choice

    def grammar(self, constraint: str | None) -> str | None:
        """The reply's grammar: with a choice that forces a call, one that makes the reply calls only; otherwise
        the response format's `constraint` (or None)."""
        if self.tool_choice != "required" and self.forced_function is None:
            return constraint
        if constraint is not None:
            raise InvalidParameter("a tool choice that forces a call cannot be combined with a response format")
        return tool_calls.grammar(list(self.tools), self.forced_function,
                                  parallel=self.parallel and self.forced_function is None, form=self.tool_format)

    def rendered(self, template_takes_tools: bool) -> tuple[list[dict], list[dict] | None]:
        """(the messages as the chat template reads them, the tools for its `tools` variable or None).

        A template without `tools` gets them as a system message (after any of the client's), and earlier calls
        as the text the model writes for them."""
        messages = []
        for turn in self.turns:
            message = {"role": turn.role, "content": turn.content}
            if turn.calls:
                if template_takes_tools:
                    message["tool_calls"] = [c | {"function": c["function"] | {"arguments": tool_calls.arguments(c)}}
                                             for c in turn.calls]
                else:
                    message["content"] = "\n".join(filter(None, [turn.content, tool_calls.as_text(list(turn.calls))]))
            if turn.call_id is not None:
                message["tool_call_id"] = turn.call_id
            messages.append(message)
        if not self.calls_tools:
            return messages, None
        if template_takes_tools:
            return messages, list(self.tools)
        system = [m for m in messages if m["role"] == "system"]
        offer = {"role": "system",
                 "content": "\n\n".join([*(m["content"] for m in system), tool_calls.preamble(list(self.tools))])}
        return [offer, *(m for m in messages if m["role"] != "system")], None

    def reply(self, text: str) -> tuple[str | None, list[dict]]:
        """(the text outside any calls, or None when the calls are all there is; the calls) of a generated reply."""
        if not self.calls_tools:
            return text, []
        return tool_calls.parse(text, self.tool_format)


@dataclass(frozen=True)
class Prompt:
    """A conversation as rendered for the served model: its token ids, and whether the prompt leaves a `<think>`
    open, which with the model's reasoning format says where its reply starts."""

    chat: Conversation
    ids: list[int]
    opened: bool  # the rendered prompt ends inside a <think> (reasoning.opened_by)

    @property
    def inside_reasoning(self) -> bool:
        return self.chat.reasoning_format == "deepseek_r1" or self.opened

    def grammar(self, constraint: str | None) -> str | None:
        """The conversation's grammar (Conversation.grammar), applied to the answer only: the reasoning before
        `</think>` stays free."""
        grammar, budget = self.chat.grammar(constraint), self.chat.reasoning_budget
        if (grammar is None and budget is None) or self.chat.reasoning_format == "none":
            return grammar
        characters = None if budget is None else budget * reasoning.CHARACTERS_PER_TOKEN
        return reasoning.after_reasoning(grammar, self.inside_reasoning, characters)

    def reasoning(self) -> reasoning.Reasoning | None:
        """A split of this reply's text into reasoning and answer, or None where the model has no reasoning."""
        if self.chat.reasoning_format == "none":
            return None
        return reasoning.Reasoning(inside=self.inside_reasoning)

    def split(self, text: str) -> tuple[str | None, str]:
        """(the reasoning, or None where the reply had none; the answer) of a whole reply."""
        split = self.reasoning()
        if split is None:
            return None, text
        split.take(text, last=True)
        return (split.reasoning if split.entered else None), split.answer
