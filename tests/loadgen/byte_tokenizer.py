"""Write the emulator's byte tokenizer (xds_mpi/model/tokenizer.py: ids 0-255 are the bytes,
256 BOS, 257 EOS, 258 PAD) as a Hugging Face tokenizer directory, for load generators that count
tokens with one (aiperf: `--tokenizer DIR`). Run with a Python that has `tokenizers` and
`transformers` (a load generator's own environment): `python byte_tokenizer.py DIR`.
"""

from __future__ import annotations

import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast

SPECIALS = {"<|bos|>": 256, "<|eos|>": 257, "<|pad|>": 258}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    # Byte-level BPE without merges: one token per UTF-8 byte, id = the byte's value.
    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins of the bytes, in byte order
    byte2char = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    assert set(byte2char.values()) == set(alphabet)
    vocab = {byte2char[b]: b for b in range(256)} | SPECIALS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


def _bytes_to_unicode() -> list[str]:
    """GPT-2's map from the 256 bytes to printable characters, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


if __name__ == "__main__":
    tokenizer = byte_tokenizer()
    assert tokenizer.encode("héllo", add_special_tokens=False) == list("héllo".encode())
    tokenizer.save_pretrained(sys.argv[1])
