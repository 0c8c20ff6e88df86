"""A character-level tokenizer for the embedded tasks, saved beside the model like any HF one.

Built with ``tokenizers`` (WordLevel over single characters) and wrapped in
``PreTrainedTokenizerFast`` so ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip
it exactly and vLLM can load it from the model directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import PreTrainedTokenizerFast

__all__ = ["SPECIAL_TOKENS", "CHARS", "char_tokenizer", "save_tokenizer"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "0123456789+-*=() "


def char_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """One token per character of ``chars``, plus pad/bos/eos/unk (ids 0–3)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if len(set(chars)) != len(chars):
        raise ValueError(f"chars must not repeat a character, got {chars!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        # transformers 4.x would also return token_type_ids, which generate() refuses.
        model_input_names=["input_ids", "attention_mask"],
    )


def save_tokenizer(tokenizer, folder: str | os.PathLike) -> None:
    """``save_pretrained``, readable by transformers 4.x too: 5.x names the fast tokenizer's class
    ``TokenizersBackend``, which 4.x cannot load; ``PreTrainedTokenizerFast`` is the same class
    under the name both know. Models saved here (zoo pairs, the real model's cache,
    checkpoints) then load under every transformers the bounds allow."""
    tokenizer.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        if config.get("tokenizer_class") == "TokenizersBackend":
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
