"""Chat templates are untrusted (they come with the GGUF): rendered in jinja2's
immutable sandbox with a range cap, a render deadline and bounded arithmetic."""

from __future__ import annotations

import time

import pytest

from aotx.device.template import ChatTemplate, TemplateError

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
