"""Whole OpenAI choices after generation: the calls of a tool-using output parsed out, and best_of's
pick of the likeliest choices."""

from __future__ import annotations

from dataclasses import replace

from app.openai.objects import Choice
from app.serving.schemas import ChatCompletionBody
from app.serving.tools import parse_output, tool_finish_reason


def with_tool_calls(body: ChatCompletionBody, choice: Choice) -> Choice:
    """A whole choice with the calls of its output parsed out."""
    content, calls = parse_output(body, choice.result.text)
    if not calls:
        return choice
    result = replace(choice.result, text=content or "",
                     finish_reason=tool_finish_reason(choice.result.finish_reason or "stop", True))
    return replace(choice, result=result, tool_calls=[call.as_dict() for call in calls])


def best_choices(choices: list[Choice], per_prompt: int, n: int) -> list[Choice]:
    """Of each prompt's `per_prompt` choices, the n whose tokens are likeliest (the highest mean log
    probability per token, as OpenAI's best_of), re-indexed in order."""
    kept: list[Choice] = []
    for start in range(0, len(choices), per_prompt):
        group = choices[start:start + per_prompt]
        group.sort(key=lambda c: -sum(e.logprob for e in c.result.logprobs) / max(1, len(c.result.logprobs)))
        kept.extend(group[:n])
    return [Choice(index, choice.result, choice.prefix) for index, choice in enumerate(kept)]
