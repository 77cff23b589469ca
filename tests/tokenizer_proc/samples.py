"""Sample texts shared by the tokenizer_proc tests."""

# Multi-byte text: accented Latin, CJK, emoji, Cyrillic, punctuation. Some of it
# (🦀, Ж, —) is not in the training corpus, so it goes through byte fallback.
TEXT = "Héllo wörld! 你好，世界 🙂🦀 naïve café Жж — ok"

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Café naïve résumé über straße.\n"
    "你好世界，今天天气很好。東京は晴れです。\n"
    "Emoji 🙂 😀 🚀 are fun! Ελληνικά και русский текст.\n"
) * 50

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Gemma's turn format (its instruction-tuned models' chat template, shortened),
# for --chat-template; the template writes <bos> itself
GEMMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
