"""Tokenizer and IncrementalDetokenizer against transformers' AutoTokenizer on the tiny model."""

import json
import random
import shutil
from datetime import datetime

import jinja2
import pytest
import transformers

from pdserve.tiny_model import ASSISTANT, BOS, EOS, USER, make_tiny_model
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.timeout(120)

TEXTS = [
    "Hello! How can I help you today?",
    "The capital of France is Paris.",
    "",
    " leading and trailing spaces  ",
    "tabs\tand\nnew\nlines\r\n",
    "café, naïve, Ångström, façade, Zürich",
    "中文的句子，还有日本語のテキストと한국어 문장。",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
    "math ∑∫√∞ ≠ ≤ ≥ and arrows → ← ↔",
    "Привет, мир! Γειά σου Κόσμε! مرحبا بالعالم שלום",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕋𝕖𝕩𝕥 and \U0010fffd private use \ue000",
    f"special tokens inside text: {USER}hi{ASSISTANT}yo{EOS}",
    "control \x00\x01\x7f chars and the replacement char \ufffd itself",
]

CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are helpful."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Et le café ? 😀"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "中文"}, {"role": "assistant", "content": None}, {"role": "user", "content": "x"}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tok(folder):
    return Tokenizer(folder)


@pytest.fixture(scope="module")
def hf(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_sizes_and_special_ids(tok, hf):
    assert tok.vocab_size == len(hf) == len(tok)
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (0, 1)
    assert tok.all_special_ids == [0, 1, 2, 3]
    assert tok.token_to_id(USER) == 2 and tok.id_to_token(3) == ASSISTANT


@pytest.mark.parametrize("text", TEXTS)
def test_utf8_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    with_bos = tok.encode(text)
    assert with_bos == [tok.bos_token_id] + ids
    if BOS not in text and EOS not in text and USER not in text:
        assert tok.decode(with_bos) == text


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(tok, hf, text):
    for add in (True, False):
        ids = tok.encode(text, add_special_tokens=add)
        assert ids == hf(text, add_special_tokens=add)["input_ids"]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_common_words_are_single_tokens(tok):
    for word in (" the", " model", " capital", "Hello", " token"):
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word


def _stream(tok, ids, skip_special_tokens=True, prompt=None):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens, prompt_token_ids=prompt)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_equals_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    for skip in (True, False):
        deltas = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        if "\ufffd" not in text:
            assert all("\ufffd" not in d for d in deltas)


def test_multibyte_characters_split_across_tokens_are_held_back(tok):
    text = "中文😀é"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 4  # each character is several byte tokens
    deltas = _stream(tok, ids)
    emitted = [d for d in deltas if d]
    assert emitted == ["中", "文", "😀", "é"]
    assert deltas.count("") == len(ids) + 1 - 4


def test_streaming_after_a_prompt_emits_only_new_text(tok):
    prompt = tok.encode("Hello! How can I help", add_special_tokens=True)
    ids = tok.encode(" you today? 😀", add_special_tokens=False)
    assert "".join(_stream(tok, ids, prompt=prompt)) == " you today? 😀"


def test_streaming_random_ids_never_splits_characters(tok):
    # What a random model emits: arbitrary byte tokens (often invalid UTF-8), special
    # tokens, and ids of the padded model vocabulary that the tokenizer does not have.
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(0, 900) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            deltas = _stream(tok, ids, skip_special_tokens=skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
            # A pushed delta never ends in U+FFFD: incomplete bytes wait for the next token or flush.
            assert not any(d.endswith("\ufffd") for d in deltas[:-1])


def test_decode_stream_and_the_python_path_give_the_same_text(tok):
    # Random prompts (some ending inside a character: the Python path until text comes out) and
    # random outputs, token by token and at the flush.
    rng = random.Random(1)
    for _ in range(300):
        prompt = [rng.randrange(0, 900) for _ in range(rng.randrange(0, 9))]
        ids = [rng.randrange(0, 900) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            fast = IncrementalDetokenizer(tok, skip, prompt)
            slow = IncrementalDetokenizer(tok, skip, prompt, use_stream=False)
            assert [fast.push(i) for i in ids] + [fast.flush()] == [slow.push(i) for i in ids] + [slow.flush()]


def test_a_token_decode_stream_refuses_takes_the_python_path(tok):
    class Refusing:  # what DecodeStream raises when a decode stops continuing its prefix's text
        def step(self, backend, token_id):
            raise Exception("Invalid prefix encountered")

    prompt = tok.encode("Hello! How can I help", add_special_tokens=True)
    ids = tok.encode(" you today? 😀 中文", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    deltas = []
    for i, t in enumerate(ids):
        if i % 3 == 0 and detok._stream is not None:
            detok._stream = Refusing()
        deltas.append(detok.push(t))
    assert "".join(deltas) + detok.flush() == " you today? 😀 中文"


def test_a_run_of_special_tokens_does_not_widen_the_decode_window(tok):
    # EOS after EOS (ignore_eos) and ids past the vocabulary decode to nothing: they are left out
    detok = IncrementalDetokenizer(tok, prompt_token_ids=tok.encode("Hi"))
    ids = tok.encode(" there 😀", add_special_tokens=False)
    deltas = [detok.push(ids[0])] + [detok.push(t) for t in [tok.eos_token_id, tok.vocab_size + 3] * 500]
    assert detok._held == [] and set(deltas[1:]) == {""}
    assert "".join(deltas + [detok.push(t) for t in ids[1:]] + [detok.flush()]) == " there 😀"


def test_no_delta_ends_inside_a_character(tok):
    # Text made of multi-byte characters: every emitted delta must decode cleanly.
    text = "é中😀" * 20
    ids = tok.encode(text, add_special_tokens=False)
    for delta in _stream(tok, ids):
        assert "\ufffd" not in delta


@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf, chat, add_generation_prompt):
    kwargs = dict(add_generation_prompt=add_generation_prompt)
    text = tok.apply_chat_template(chat, tokenize=False, **kwargs)
    assert text == hf.apply_chat_template(chat, tokenize=False, **kwargs)
    ids = tok.apply_chat_template(chat, tokenize=True, **kwargs)
    assert ids == hf.apply_chat_template(chat, tokenize=True, return_dict=False, **kwargs)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_chat_template_deepseek_layout(tok):
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "U2"},
    ]
    assert tok.apply_chat_template(chat) == f"{BOS}S{USER}U1{ASSISTANT}A1{EOS}{USER}U2{ASSISTANT}"
    assert tok.apply_chat_template(chat, add_generation_prompt=False).endswith(f"{USER}U2")


def test_unknown_role_raises_template_error(tok, hf):
    chat = [{"role": "wizard", "content": "x"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unsupported message role: wizard"):
        tok.apply_chat_template(chat)
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unsupported message role: wizard"):
        hf.apply_chat_template(chat, tokenize=False)


def test_template_features_match_transformers(tok, hf):
    template = (
        "{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{{ m | tojson }}\n"
        "{% endfor %}"
        "{{ tools | tojson(indent=2) }} n={{ ns.n }} {{ bos_token }}|{{ eos_token }}|{{ pad_token }} {{ flavour }}"
        "{% generation %}G{% endgeneration %}"
    )
    chat = [{"role": "user", "content": "<b>café</b> & 😀"}, {"role": "user", "content": "2"}, {"role": "x"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "ü"}}]
    kwargs = dict(chat_template=template, tools=tools, flavour="mint", add_generation_prompt=True)
    assert tok.apply_chat_template(chat, **kwargs) == hf.apply_chat_template(chat, tokenize=False, **kwargs)
    year = tok.apply_chat_template(chat, chat_template="{{ strftime_now('%Y') }}")
    assert year == str(datetime.now().year)


def test_continue_final_message_matches_transformers(tok, hf):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    kwargs = dict(add_generation_prompt=False, continue_final_message=True)
    text = tok.apply_chat_template(chat, **kwargs)
    assert text == hf.apply_chat_template(chat, tokenize=False, **kwargs)
    assert text.endswith(f"{ASSISTANT}The answer is")
    with pytest.raises(ValueError, match="cannot be used together"):
        tok.apply_chat_template(chat, continue_final_message=True)


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in .*skip_tokenizer_init"):
        Tokenizer(tmp_path)


def test_no_chat_template_is_a_clear_error(folder, tmp_path):
    shutil.copy(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer(tmp_path)
    # Without tokenizer_config.json nothing is named BOS, but tokenizer.json's post-processor still adds it.
    assert tok.bos_token_id is None and tok.encode("Hello")[0] == 0
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("add_bos", [True, False])
def test_without_post_processor_add_bos_token_decides(folder, tmp_path, add_bos):
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    spec["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["add_bos_token"] = add_bos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ids = Tokenizer(tmp_path).encode("Hello")
    assert (ids[0] == 0) is add_bos and len(ids) == 1 + add_bos


def test_chat_template_file_wins_and_missing_special_tokens_are_added(folder, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("[{{ messages[0]['content'] }}]{{ sep_token }}")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["sep_token"] = {"content": "<sep>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = Tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]<sep>"
    sep = tok.token_to_id("<sep>")
    assert sep is not None and sep in tok.all_special_ids
    assert tok.encode("a<sep>b", add_special_tokens=False).count(sep) == 1
