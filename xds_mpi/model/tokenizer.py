"""Byte-level tokenizer: ids 0..255 are bytes, then the special tokens, all within vocab 260."""

from __future__ import annotations

NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
NUM_SPECIAL = 3


class ByteTokenizer:
    """UTF-8 bytes in, UTF-8 bytes out; `encode` prefixes BOS, `decode` drops special tokens."""

    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID

    def __init__(self, vocab_size: int = 260) -> None:
        if vocab_size < NUM_BYTES + NUM_SPECIAL:
            raise ValueError(
                f"a byte-level tokenizer needs vocab_size >= {NUM_BYTES} bytes + "
                f"{NUM_SPECIAL} specials = {NUM_BYTES + NUM_SPECIAL}, "
                f"got {vocab_size}"
            )
        self.vocab_size = vocab_size

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )
        # A random-weight model emits arbitrary bytes; invalid UTF-8 becomes U+FFFD.
        return bytes(t for t in ids if t < NUM_BYTES).decode("utf-8", errors="replace")
