"""Chat templates render exactly as transformers' apply_chat_template does, for the three
template families most checkpoints use (Llama 3, ChatML/Qwen2, Mistral), built here; template
errors (raise_exception, sandbox escapes) are INVALID_ARGUMENT; the template comes from
tokenizer_config.json, chat_template.jinja or --chat-template. (A chat request to a model without
one: tests/test_http_api.py::test_server_without_a_chat_template_and_with_max_model_len.)"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from adapter_cache.errors import InvalidArgumentError
from inference_service.frontend.chat_template import ChatTemplate, load_chat_template

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# Block tags on their own lines: trim_blocks / lstrip_blocks decide the whitespace; tojson must
# not escape HTML or non-ASCII; loop controls are enabled.
MULTILINE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% continue %}
    {% endif %}
<{{ message['role'] }}> {{ message['content'] | tojson }}
{% endfor %}
{% if add_generation_prompt %}
<assistant>
{% endif %}"""
TEMPLATES = {"llama3": LLAMA3, "qwen2": QWEN2, "mistral": MISTRAL, "multiline": MULTILINE}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "  2+2?  "}],
    [{"role": "user", "content": "Héllo <b>wörld</b> 日本 🎉"}, {"role": "assistant", "content": "Hi & bye"},
     {"role": "user", "content": "again\nwith \"quotes\""}],
]


def hf_tokenizer(template: str) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), **SPECIAL)
    tok.chat_template = template
    return tok


def _applicable(name: str, conversation: list[dict]) -> bool:
    return name != "mistral" or all(m["role"] != "system" for m in conversation)


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(name, add_generation_prompt):
    ours = ChatTemplate(TEMPLATES[name], SPECIAL)
    reference = hf_tokenizer(TEMPLATES[name])
    checked = 0
    for conversation in CONVERSATIONS:
        if not _applicable(name, conversation):
            continue
        expected = reference.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        assert ours.render(conversation, add_generation_prompt) == expected, (name, conversation)
        checked += 1
    assert checked >= 2


def test_continue_final_message_like_transformers():
    conversation = [{"role": "user", "content": "Write"}, {"role": "assistant", "content": "Once upon"}]
    for name in ("llama3", "qwen2", "mistral"):
        expected = hf_tokenizer(TEMPLATES[name]).apply_chat_template(conversation, tokenize=False,
                                                                    continue_final_message=True)
        got = ChatTemplate(TEMPLATES[name], SPECIAL).render(conversation, add_generation_prompt=False,
                                                            continue_final_message=True)
        assert got == expected, name


def test_raise_exception_is_invalid_argument():
    with pytest.raises(InvalidArgumentError, match="roles must alternate"):
        ChatTemplate(MISTRAL, SPECIAL).render([{"role": "assistant", "content": "first"}])
    with pytest.raises(Exception, match="roles must alternate"):  # as transformers does
        hf_tokenizer(MISTRAL).apply_chat_template([{"role": "assistant", "content": "first"}], tokenize=False)


@pytest.mark.parametrize("escape", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set x = messages.append({'role': 'x'}) %}",  # immutable: templates cannot change their input
])
def test_sandbox_refuses_escapes(escape):
    with pytest.raises(InvalidArgumentError):
        ChatTemplate(escape, SPECIAL).render([{"role": "user", "content": "hi"}])


def test_unbounded_output_is_refused():
    template = "{% for i in range(100000) %}{{ messages[0]['content'] }}{% endfor %}"
    with pytest.raises(InvalidArgumentError):
        ChatTemplate(template, SPECIAL).render([{"role": "user", "content": "x" * 100}])


def test_syntax_error_is_a_startup_error():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_loaded_from_the_checkpoint_or_the_override(tmp_path):
    ckpt = tmp_path / "model"
    ckpt.mkdir()
    assert load_chat_template(str(ckpt)) is None
    assert load_chat_template("builtin:tiny") is None
    (ckpt / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": QWEN2, "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    conversation = CONVERSATIONS[0]
    qwen = hf_tokenizer(QWEN2).apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert load_chat_template(str(ckpt)).render(conversation) == qwen
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (ckpt / "chat_template.jinja").write_text(MISTRAL)
    mistral = hf_tokenizer(MISTRAL).apply_chat_template(conversation, tokenize=False)
    loaded = load_chat_template(str(ckpt))
    assert loaded.render(conversation, add_generation_prompt=False) == mistral
    override = tmp_path / "llama3.jinja"
    override.write_text(LLAMA3)
    llama = hf_tokenizer(LLAMA3).apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert load_chat_template(str(ckpt), str(override)).render(conversation) == llama

