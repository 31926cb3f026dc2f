"""Chat prompts: how a conversation becomes the prompt text, per model family.

    dsv4.py      DeepSeek-V4's encoder (the release ships Python, not a Jinja template)
    dsv4_revision.py  which revision of it (reasoning-effort texts) a checkpoint was trained with
    jinja.py     Jinja chat templates (DeepSeek-V3 / V3.1 / V3.2 / R1 ship one), rendered as transformers does
    controls.py  a request's thinking / reasoning-effort / chat_template_kwargs, checked against what the
                 template reads, with the server's defaults
    tool_grammar.py  tool_choice "required" / a named function as a grammar of the DSML call block (V4, V3.2)
    tool_grammar_v3.py  the same for V3's and V3.1's call blocks
    markup_free.py   JSON schemas whose strings cannot hold a format's markup

pdserve.tokenizer.Tokenizer.apply_chat_template picks the encoder: a checkpoint's Jinja template
when it ships one, the built-in V4 encoder for a deepseek_v4 checkpoint that ships none.
"""
