"""Chat template: byte-identical to transformers' rendering (the oracle)."""

from __future__ import annotations

import pytest
from nanoqwen_runtime import ChatTemplate, ChatTemplateError
from nanoqwen_runtime.testing import QWEN_CHAT_TEMPLATE
from transformers.utils.chat_template_utils import render_jinja_template

CONVERSATIONS = [
    [{"role": "user", "content": "Write is_prime(n)."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "a1 with \"quotes\" & <tags>"},
     {"role": "user", "content": "q2 ü 日本"}],
    [{"role": "user", "content": "  leading and trailing spaces\n\n"},
     {"role": "assistant", "content": "```python\ndef f():\n    pass\n```"}, {"role": "user", "content": ""}],
]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Städte & <Wetter>",
                                           "parameters": {"type": "object", "properties": {}}}}]


def hf_render(template: str, messages, add_generation_prompt: bool, **kw) -> str:
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                        add_generation_prompt=add_generation_prompt, **kw)
    return rendered[0]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_tiny_template_matches_transformers(messages, gen):
    ours = ChatTemplate(QWEN_CHAT_TEMPLATE).render(messages, add_generation_prompt=gen)
    assert ours == hf_render(QWEN_CHAT_TEMPLATE, messages, gen)


def test_jinja_features_as_transformers_sets_them():
    # trim_blocks/lstrip_blocks, tojson without HTML escaping, non-ASCII kept, raise_exception, loopcontrols
    template = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'system' %}{% continue %}{% endif %}\n"
        "    {{ m | tojson }}|{{ m.content | tojson(indent=2) }}\n"
        "{% endfor %}\n"
        "{% if messages | length > 3 %}{{ raise_exception('too many: ' ~ messages | length) }}{% endif %}"
        "{{ bos_token }}"
    )
    msgs = [{"role": "system", "content": "x"}, {"role": "user", "content": "<b>é</b> & \"q\""}]
    ours = ChatTemplate(template, {"bos_token": "<s>"}).render(msgs, add_generation_prompt=False)
    assert ours == hf_render(template, msgs, False, bos_token="<s>")
    assert '"<b>é</b> & \\"q\\""' in ours
    with pytest.raises(ChatTemplateError, match="too many: 4"):
        ChatTemplate(template).render(msgs * 2, add_generation_prompt=False)


def test_bad_messages_and_templates():
    t = ChatTemplate(QWEN_CHAT_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="unknown role"):
        t.render([{"role": "robot", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="content must be a string"):
        t.render([{"role": "user", "content": 3}])
    with pytest.raises(ChatTemplateError, match="no messages"):
        t.render([])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_from_file(tiny_bf16):
    t = ChatTemplate.from_file(tiny_bf16)
    assert t.special_tokens == {"bos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                                "eos_token": "<|im_end|>"}
    assert t.render(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


@pytest.mark.model
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_qwen05b_template_matches_apply_chat_template(qwen_packed_none, qwen_hf_tokenizer, messages):
    ours = ChatTemplate.from_file(qwen_packed_none)
    for gen in (True, False):
        want = qwen_hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.render(messages, add_generation_prompt=gen) == want
    want = qwen_hf_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                 add_generation_prompt=True)
    assert ours.render(messages, tools=TOOLS) == want
