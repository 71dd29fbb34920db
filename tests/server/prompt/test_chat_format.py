"""server/prompt/chat.py on its own: messages to the template's dicts (parts kept or joined, null content,
tool calls with decoded arguments, tool messages), render options, and a template that renders tool
calls (Hermes style, as Qwen's) seeing them."""

from __future__ import annotations

import pytest

from server.http.errors import ApiError
from server.prompt.chat import ChatMessage, render_options, template_messages
from server.prompt.codec import PARTS, STRING

from ..fake_engine import FakeTokenizer

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


def msgs(*raw):
    return [ChatMessage.model_validate(m) for m in raw]


def test_parts_are_joined_for_string_templates_and_kept_for_part_templates():
    m = msgs({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]})
    assert template_messages(m, STRING) == [{"role": "user", "content": "ab"}]
    assert template_messages(m, PARTS) == [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}]  # fmt: skip


def test_assistant_tool_calls_and_tool_messages():
    out = template_messages(msgs({"role": "assistant", "content": None, "tool_calls": [CALL]},
                                 {"role": "tool", "tool_call_id": "c1", "content": "2", "name": "f"}), STRING)  # fmt: skip
    assert out[0] == {"role": "assistant", "content": "",
                      "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {"x": 1}}}]}  # fmt: skip
    assert out[1] == {"role": "tool", "content": "2", "name": "f", "tool_call_id": "c1"}
    not_json = {**CALL, "function": {"name": "f", "arguments": "not json"}}
    kept = template_messages(msgs({"role": "assistant", "content": "x", "tool_calls": [not_json]}), STRING)
    assert kept[0]["tool_calls"][0]["function"]["arguments"] == "not json"


@pytest.mark.parametrize("raw, param", [
    ({"role": "user", "content": None}, "messages.0.content"),
    ({"role": "user", "content": [{"type": "image_url"}]}, "messages.0.content.0.type"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages.0.content.0.text"),
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "messages.0.tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}, "messages.0.tool_calls.0.function"),
    ({"role": "tool", "content": "x"}, "messages.0.tool_call_id"),
])  # fmt: skip
def test_invalid_messages_name_the_field(raw, param):
    with pytest.raises(ApiError) as e:
        template_messages(msgs(raw), STRING)
    assert e.value.status == 400 and e.value.param == param


def test_render_options():
    assert render_options(True, False, {"enable_thinking": False}) == {"enable_thinking": False,
                                                                       "add_generation_prompt": True}  # fmt: skip
    assert render_options(False, True, None) == {"add_generation_prompt": False, "continue_final_message": True}
    with pytest.raises(ApiError) as e:
        render_options(True, False, {"chat_template": "x"})
    assert e.value.param == "chat_template_kwargs.chat_template"


def test_a_template_that_renders_tool_calls_sees_decoded_arguments():
    from engine.text.tokenization import chat_prompt_ids

    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
                "\n{% endfor %}")  # fmt: skip

    class Tok(FakeTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, chat_template=None, **kw):
            from jinja2 import Environment

            text = Environment().from_string(chat_template or template).render(messages=messages, **kw)
            return self.encode(text) if tokenize else text

    tok = Tok()
    out = template_messages(msgs({"role": "assistant", "content": None, "tool_calls": [CALL]}), STRING)
    assert tok.decode(chat_prompt_ids(tok, out)) == 'assistant:<tool_call>{"x": 1}</tool_call>\n'
