"""Text <-> token ids for chat-style generation: the tokenizer's chat template in, text up to EOS out.

The tokenizer is a transformers `PreTrainedTokenizerFast` (what `sage_jax.io.load_lm` returns). In transformers v5
`apply_chat_template(..., tokenize=True)` returns a `BatchEncoding`, so we render the template to text and encode
that without adding special tokens again (the template already holds them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def prompt_ids(tokenizer, text: str, *, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat prompt ending where the assistant's answer starts.

    Without a chat template the text is encoded as is (with the tokenizer's own special tokens, e.g. BOS).
    """
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def until_eos(ids: Sequence[int], eos_ids: Iterable[int]) -> list[int]:
    """`ids` cut before the first end-of-sequence token."""
    eos = set(eos_ids)
    for i, t in enumerate(ids):
        if t in eos:
            return list(ids[:i])
    return list(ids)


def decode(tokenizer, ids: Sequence[int], eos_ids: Iterable[int] = ()) -> str:
    """Text of generated `ids` up to the first EOS (the model's `eos_ids` or the tokenizer's), specials dropped."""
    eos = set(eos_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)
    return tokenizer.decode(until_eos(ids, eos), skip_special_tokens=True).strip()
