"""Chat templates are untrusted (they come with the GGUF): rendered in jinja2's
immutable sandbox with a range cap, a render deadline and bounded arithmetic."""

from __future__ import annotations

import os
import time

import pytest

from aotx.device.template import ChatTemplate, TemplateError
from aotx.wire import ToolFormat

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HELLO = [{"role": "user", "content": "hello"}]


def test_a_chatml_template_renders() -> None:
    assert ChatTemplate(CHATML).render(HELLO) == (
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("body,words", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox"),
    ("{{ messages.append(1) }}", "sandbox"),
    ("{% for i in range(10**9) %}{% endfor %}", "range"),
    ("{{ 'x' * 10**10 }}", "too large"),
    ("{{ [1] * 10**9 }}", "too large"),
    ("{{ 10 ** 100000000 }}", "power too large"),
    ("{% set s = 'x' * 4000000 %}{{ (s + s) | length }}", "too large"),
    ("{{ raise_exception('no system role') }}", "no system role"),
])
def test_hostile_templates_are_refused_when_loaded(body: str, words: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match=words):
        ChatTemplate(CHATML + body)
    assert time.monotonic() - t0 < 5


def test_a_template_that_runs_too_long_is_stopped() -> None:
    slow = CHATML + ("{% for i in range(100000) %}{% for j in range(100000) %}"
                     "{{ messages[0]['role'] }}{% endfor %}{% endfor %}")
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match="longer than"):
        ChatTemplate(slow)
    assert time.monotonic() - t0 < 5


def test_bounded_arithmetic_still_works() -> None:
    t = ChatTemplate(CHATML + "{{ '-' * 3 }}{{ 2 ** 10 }}{{ 'a' + 'b' }}{{ 3 * 4 }}")
    assert t.render(HELLO).endswith("---1024ab12")


# -- tools: the template's own format (issue 20) -----------------------------------------------
TEMPLATES = os.path.join(os.path.dirname(__file__), "..", "data", "templates")


def bundled(name: str) -> ChatTemplate:
    """A real model's template, as llama.cpp's repository keeps it (models/templates)."""
    with open(os.path.join(TEMPLATES, name + ".jinja")) as f:
        return ChatTemplate(f.read(), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


@pytest.mark.parametrize("name,fmt", [
    ("Qwen-Qwen2.5-7B-Instruct", ToolFormat.HERMES),
    ("Qwen-Qwen3-0.6B", ToolFormat.HERMES),
    ("meta-llama-Llama-3.1-8B-Instruct", ToolFormat.LLAMA3),
    ("meta-llama-Llama-3.2-3B-Instruct", ToolFormat.LLAMA3),
    ("mistralai-Mistral-Nemo-Instruct-2407", ToolFormat.FALLBACK),  # [TOOL_CALLS]: not ours
    ("openai-gpt-oss-120b", ToolFormat.HARMONY),  # the commentary channel
])
def test_the_tool_format_is_found_by_rendering_a_probe(name: str, fmt: ToolFormat) -> None:
    assert bundled(name).tool_format is fmt


def test_a_template_without_tools_is_the_fallback() -> None:
    assert ChatTemplate(CHATML).tool_format is ToolFormat.FALLBACK
    # one that mentions tools but writes no call in a known format
    partial = CHATML + "{% if tools %}{{ tools | tojson }}{% endif %}"
    assert ChatTemplate(partial).tool_format is ToolFormat.FALLBACK


def test_tools_calls_and_results_are_rendered_as_transformers_renders_them() -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & 'then'",
                                             "parameters": {"type": "object", "properties": {}}}}
    msgs = [{"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = bundled("Qwen-Qwen2.5-7B-Instruct").render(msgs, tools=[tool])
    # tojson does not HTML-escape (jinja2's own would write \u003cnow\u003e)
    assert '"description": "Weather <now> & \'then\'"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    llama = bundled("meta-llama-Llama-3.2-3B-Instruct").render(msgs, tools=[tool])
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in llama
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n\"sunny\"<|eot_id|>" in llama


@pytest.mark.parametrize("name,thinks,channels", [
    ("Qwen-Qwen2.5-7B-Instruct", False, False),
    ("Qwen-Qwen3-0.6B", True, False),  # <think> ... </think>
    ("meta-llama-Llama-3.1-8B-Instruct", False, False),
    ("meta-llama-Llama-3.2-3B-Instruct", False, False),
    ("mistralai-Mistral-Nemo-Instruct-2407", False, False),
    ("../think-open", True, False),  # DeepSeek R1's way: the prompt opens the block
    ("../harmony", True, True),  # gpt-oss's channels
    ("openai-gpt-oss-120b", True, True),
])
def test_which_templates_think(name: str, thinks: bool, channels: bool) -> None:
    t = bundled(name)
    assert (t.thinks, t.channels) == (thinks, channels)
