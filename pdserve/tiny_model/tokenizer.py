"""The tiny checkpoints' tokenizer: byte-level BPE (any UTF-8 text round-trips) trained on the
embedded text below, DeepSeek's special tokens and a DeepSeek-style chat template (what
tokenizer.json and tokenizer_config.json hold).

deepseek_v4 ships as the release does: the tokens its encoder writes (think tags, DSML, the
reminder and task tokens) and no chat template, so pdserve's built-in V4 encoder renders chats.
Those tokens come after the trained vocabulary, so the other ids are the same for every arch."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pdserve.chat import dsv4

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT]  # ids 0, 1, 2, 3
# DeepSeek-V4's further tokens: think tags and DSML decode as text (the output parser reads them).
V4_TEXT_TOKENS = [dsv4.THINK, dsv4.END_THINK, dsv4.DSML]
V4_SPECIAL_TOKENS = [dsv4.REMINDER, *dsv4.TASK_TOKENS.values()]

# Upper bound on the BPE size (4 special + 256 byte tokens + merges); training on _CORPUS stops
# earlier, once every corpus word is a single token.
TOKENIZER_TARGET_SIZE = 1000

# DeepSeek-V3's layout: system prompts first, then <｜User｜>/<｜Assistant｜> turns, assistant
# turns closed by EOS. Content may be a string or a list of {"type": "text"} parts.
CHAT_TEMPLATE = (
    "{% macro text(content) %}"
    "{% if content is string %}{{ content }}"
    "{% elif content is iterable %}"
    "{% for part in content %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{% endmacro %}"
    "{% set ns = namespace(system_prompt='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if ns.system_prompt %}{% set ns.system_prompt = ns.system_prompt + '\n\n' %}{% endif %}"
    "{% set ns.system_prompt = ns.system_prompt + text(message['content']) %}"
    "{% endif %}"
    "{% endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '<｜User｜>' + text(message['content']) }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + text(message['content']) + eos_token }}"
    "{% elif message['role'] != 'system' %}"
    "{{ raise_exception('Unsupported message role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

# Training text for the BPE merges: plain English, so common words become single tokens.
_CORPUS = """\
Hello! How can I help you today? I am a small assistant and I will do my best to answer.
The quick brown fox jumps over the lazy dog. The dog does not move, and the fox runs away.
A language model reads a sequence of tokens and predicts the next token, one at a time.
When the model serves many users at once, it keeps the keys and values of every request
in a cache, so that it does not have to compute the whole prompt again for each new token.
The first part of a request is the prompt. The prompt is processed in one large step, which
is called prefill. After that, the model writes the answer token by token, which is called
decode. Prefill is limited by how fast the machine can compute, and decode is limited by how
fast it can read memory. This is why some systems run the two parts on different machines.
What is the capital of France? The capital of France is Paris. What is the weather like
today? It is warm and sunny in the morning, and it may rain in the afternoon or the evening.
Please write a short story about a cat who wants to learn to read. Once upon a time there
was a small cat who lived in a large house with many books. Every day she looked at the
pages and wondered what the words could mean. One night she found an old teacher who lived
in the library, and he showed her the letters one by one. She learned quickly, and soon
she could read all the stories in the house. She told them to the other animals, and they
listened to her every evening until the sun went down and the stars came out in the sky.
Thank you for your question. Here is a simple answer with three points. First, you should
check that the input is correct. Second, you should run the tests before you change the
code. Third, you should write down what you learned, so that other people can use it too.
Numbers and dates: one, two, three, four, five, six, seven, eight, nine, ten; 2024, 2025,
100, 1000, 3.14, 42. Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
People often ask the same questions: who, what, where, when, why and how. They want to know
the time, the place, the reason and the way. A good answer is short, clear and true.
The system has a router, a prefill worker and a decode worker. The router receives each
request, chooses a worker and sends the result back to the user as a stream of text.
If something goes wrong, the user should get a clear error message, never a wrong answer.
"""


def build_tokenizer(arch: str = "deepseek_v3") -> Tokenizer:
    """Byte-level BPE trained on `_CORPUS`; BOS is prepended by the post-processor."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_TARGET_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    if arch == "deepseek_v4":
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in V4_TEXT_TOKENS])
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in V4_SPECIAL_TOKENS])
    return tokenizer


def tokenizer_config(arch: str = "deepseek_v3") -> dict:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    if arch == "deepseek_v4":
        del config["chat_template"]  # the release ships a Python encoder, not a template
    return config
