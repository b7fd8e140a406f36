"""Tool-calling conversations: `tools` reach the chat template, `tool` results and assistant `tool_calls` render
as transformers renders them (ids identical to `apply_chat_template(messages, tools=..., tokenize=True)`), and the
loss mask trains the assistant's calls and answers only. Two templates in the manner of Qwen2.5 (tools in the
system turn, consecutive results grouped in one user turn) and Llama 3.1 (a dated system header before every
conversation, tools in the first user turn), which renders no message independently of the others: its
conversations are rendered whole and masked by prefix renders, with tools or without."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml
from datasets import load_dataset
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from astrai_pl.data import SFTData
from astrai_pl.data.formats import encode_row
from astrai_pl.data.preprocess import Section, preset_sections, render_example
from astrai_pl.data.rows import DataError
from astrai_pl.tokenizer import load_tokenizer

CHATML_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You help.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nReply with <tool_call></tool_call> around {\"name\": ..., \"arguments\": ...}.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{%- if call.function.arguments is string %}{{- call.function.arguments }}"
    "{%- else %}{{- call.function.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
HEADERS_TOOLS = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + (date_string if date_string is defined else '26 Jul 2024') + '\\n\\n' + system + '<|eot_id|>' }}"
    "{%- for message in rest %}"
    "{%- if loop.first and tools and message.role == 'user' %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nCall one of these as {\"name\": ..., \"parameters\": ...}.\\n\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson(indent=4) + '\\n\\n' }}{%- endfor %}"
    "{{- message.content + '<|eot_id|>' }}"
    "{%- elif message.tool_calls %}{%- set fn = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + fn.name + '\", \"parameters\": ' }}"
    "{{- fn.arguments | tojson + '}<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
STYLES = {
    "chatml": (CHATML_TOOLS, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, ["<|im_start|>"]),
    "headers": (HEADERS_TOOLS, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                "pad_token": "<|finetune_pad|>"}, ["<|start_header_id|>", "<|end_header_id|>"]),
}
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Today's weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}


def _call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATION = [
    {"role": "system", "content": "Use tools for arithmetic."},
    {"role": "user", "content": "What is 12 * 7, and 5 + 5?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("calculator", {"expression": "12 * 7"})]},
    {"role": "tool", "content": "84"},
    {"role": "assistant", "tool_calls": [_call("calculator", '{"expression": "5 + 5"}')]},  # a JSON string
    {"role": "tool", "content": "10"},
    {"role": "assistant", "content": "84 and 10."},
]
GROUPED = [  # two results in a row: one user turn in the ChatML-style template
    {"role": "user", "content": "Weather in Oslo, and 2 + 2?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [_call("weather", {"city": "Oslo"}),
                                                                 _call("calculator", {"expression": "2 + 2"})]},
    {"role": "tool", "content": "rain, 4 C"},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "Rain and 4."},
]


def _folder(tmp_path_factory, style):
    """A small byte-level BPE with the style's specials and template, saved by transformers."""
    template, specials, extra = STYLES[style]
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokens = [*specials.values(), *extra]
    corpus = [json.dumps(CONVERSATION), json.dumps([CALCULATOR, WEATHER]), "calculator expression arguments"]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=tokens,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    hf.chat_template = template
    folder = tmp_path_factory.mktemp(style)
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module", params=sorted(STYLES))
def tokenizers_pair(request, tmp_path_factory):
    folder, hf = _folder(tmp_path_factory, request.param)
    return request.param, load_tokenizer(str(folder)), hf


def _trained_texts(tokenizer, out):
    ids, mask = out["input_ids"], out["loss_mask"]
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


@pytest.mark.parametrize("tools_from", ["row", "row_json", "section"])
def test_ids_equal_transformers_and_only_the_assistant_trains(tokenizers_pair, tools_from):
    style, ours, hf = tokenizers_pair
    messages = CONVERSATION if style == "headers" else CONVERSATION[:1] + GROUPED  # one call per turn there
    tools = [CALCULATOR, WEATHER]
    sections = preset_sections("messages")
    row = {"messages": messages}
    if tools_from == "section":
        sections = [Section("messages", template=True, tools=tools)]
    else:
        row["tools"] = json.dumps(tools) if tools_from == "row_json" else tools
    out = encode_row(row, sections, ours)
    assert out["input_ids"] == hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    runs = _trained_texts(ours, out)
    assistant = [m for m in messages if m["role"] == "assistant"]
    assert len(runs) == len(assistant) and all(run.rstrip("\n").endswith(ours.eos_token) for run in runs)  # each turn stops
    for run, message in zip(runs, assistant):  # the call or answer, without the header the prompt supplies
        assert run.startswith(message.get("content") or ("<tool_call>" if style == "chatml" else "{"))
        assert all(call["function"]["name"] in run for call in message.get("tool_calls") or [])
    trained = "".join(runs)
    for forbidden in ("description", "tool_response", "ipython", "Use tools for arithmetic", "rain, 4 C", "84\n"):
        assert forbidden not in trained  # schemas, tool results, system and user turns stay masked


def test_tool_results_render_grouped_as_transformers_does(tokenizers_pair):
    style, ours, hf = tokenizers_pair
    if style != "chatml":
        pytest.skip("the headers-style template renders one call per turn")
    out = encode_row({"messages": GROUPED}, preset_sections("messages"), ours)  # no tools: results and calls only
    assert out["input_ids"] == hf.apply_chat_template(GROUPED, tokenize=True, return_dict=False)
    assert render_example(out["input_ids"], out["loss_mask"], ours).count("<tool_response>") == 2


def test_rows_read_through_datasets_encode_as_the_original(tmp_path, tokenizers_pair):
    """A jsonl read by `datasets` gives every argument object the keys of all of them (null where absent)."""
    _, ours, hf = tokenizers_pair
    rows = [{"messages": CONVERSATION, "tools": [CALCULATOR, WEATHER]},
            {"messages": [{"role": "user", "content": "Oslo?"},
                          {"role": "assistant", "tool_calls": [_call("weather", {"city": "Oslo", "unit": "C"})]},
                          {"role": "tool", "content": "rain"}, {"role": "assistant", "content": "Rain."}],
             "tools": [WEATHER]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "cache"))
    for original, row in zip(rows, loaded):
        out = encode_row(row, preset_sections("messages"), ours)
        assert out["input_ids"] == hf.apply_chat_template(original["messages"], tools=original["tools"],
                                                          tokenize=True, return_dict=False)


@pytest.mark.parametrize("bad, field", [
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}, "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [_call("calculator", 3)]}, "messages[1].tool_calls[0].function.arguments"),
    ({"role": "user", "content": "x", "tool_calls": [_call("calculator", {})]}, "messages[1].tool_calls"),
])
def test_a_malformed_tool_call_names_its_field(tokenizers_pair, bad, field):
    _, ours, _ = tokenizers_pair
    with pytest.raises(DataError, match=field.replace("[", r"\[").replace("]", r"\]")):
        encode_row({"messages": [{"role": "user", "content": "hi"}, bad]}, preset_sections("messages"), ours)


def test_tools_that_are_not_schemas_are_an_error(tokenizers_pair):
    _, ours, _ = tokenizers_pair
    with pytest.raises(DataError, match="tools"):
        encode_row({"messages": CONVERSATION, "tools": "[not json"}, preset_sections("messages"), ours)
    with pytest.raises(DataError, match="tools"):
        encode_row({"messages": CONVERSATION, "tools": ["calculator"]}, preset_sections("messages"), ours)


def test_a_template_that_ignores_tools_or_calls_is_an_error(tokenizers_pair):
    """Plain ChatML writes neither the schemas nor the calls: training on its render would teach no tool use."""
    _, ours, _ = tokenizers_pair
    plain = load_tokenizer("byte")
    plain.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + "
                           "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                           "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    with pytest.raises(DataError, match="does not write the tool schemas"):
        encode_row({"messages": CONVERSATION, "tools": [CALCULATOR]}, preset_sections("messages"), plain)
    with pytest.raises(DataError, match=r"does not write the tool call 'calculator'"):
        encode_row({"messages": CONVERSATION}, preset_sections("messages"), plain)
    encode_row({"messages": CONVERSATION, "tools": [CALCULATOR]}, preset_sections("messages"), ours)


def test_the_byte_tokenizer_template_renders_tools_and_plain_chats_as_before():
    tok = load_tokenizer("byte")
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert tok.apply_chat_template(plain, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n")
    out = encode_row({"messages": CONVERSATION, "tools": [CALCULATOR]}, preset_sections("messages"), tok)
    runs = _trained_texts(tok, out)
    assert runs[0] == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call><|im_end|>\n'
    assert runs[-1] == "84 and 10.<|im_end|>\n" and len(runs) == 3
    assert "Evaluate an arithmetic expression." in tok.decode(out["input_ids"])


def test_the_shipped_tool_config_prepares_and_prints_a_row_with_its_tools(tmp_path, caplog):

    root = Path(__file__).resolve().parents[2]
    args = yaml.safe_load((root / "configs" / "sft" / "tools-debug.yaml").read_text())["data"]["init_args"]
    args.update(path=str(root / args["path"]), cache_dir=str(tmp_path), sections=[Section(**s) for s in args["sections"]])
    data = SFTData(**{k: v for k, v in args.items() if k != "synthetic"})
    with caplog.at_level(logging.INFO):
        data.setup("fit")
    shown = caplog.text
    assert "<tools>" in shown and "[[<tool_call>" in shown and "]]<|im_start|>user\n<tool_response>" in shown
    assert len(data.train_set) > 0


PLAIN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 * 7?"},
         {"role": "assistant", "content": "84"}, {"role": "user", "content": "And 5 + 5?"},
         {"role": "assistant", "content": "10"}]


@pytest.mark.parametrize("messages", [PLAIN, PLAIN[1:3]], ids=["system", "no_system"])
def test_a_conversation_without_tools_encodes_as_transformers_renders_it(tokenizers_pair, messages):
    """Llama 3.1's system header (with its date) precedes every conversation: rendering messages alone would
    repeat it before each one."""
    _, ours, hf = tokenizers_pair
    out = encode_row({"messages": messages}, preset_sections("messages"), ours)
    assert out["input_ids"] == hf.apply_chat_template(messages, tokenize=True, return_dict=False)
    runs = [run.rstrip("\n") for run in _trained_texts(ours, out)]
    assert runs == [m["content"] + ours.eos_token for m in messages if m["role"] == "assistant"]


def test_sft_data_prepares_tool_rows_with_a_llama_style_template(tmp_path, tmp_path_factory, caplog):
    """Preflight accepts the template, prints one rendered row (tools in the first user turn, the call
    trained, the tool's result not) and every row is encoded as transformers renders it."""
    folder, hf = _folder(tmp_path_factory, "headers")
    rows = [{"messages": CONVERSATION, "tools": [CALCULATOR, WEATHER]}, {"messages": PLAIN}] * 4
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = SFTData(path=str(path), tokenizer=str(folder), cache_dir=str(tmp_path / "cache"), max_seq_len=1024,
                   packing="none", val_fraction=0.3, batch_size=2)
    with caplog.at_level(logging.INFO):
        data.setup("fit")
    shown = caplog.text
    assert "Cutting Knowledge Date" in shown and '"name": "calculator"' in shown
    assert '[[{"name": "calculator", "parameters": {"expression": "12 * 7"}}<|eot_id|>]]' in shown
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n84<|eot_id|>" in shown  # masked: outside [[ ]]
    for example in [*data.train_set, *data.val_set]:
        ids = example["input_ids"]
        original = rows[0] if "ipython" in hf.decode(ids) else rows[1]
        assert ids == hf.apply_chat_template(original["messages"], tools=original.get("tools"), tokenize=True,
                                             return_dict=False)
