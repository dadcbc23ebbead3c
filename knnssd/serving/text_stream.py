"""A sequence's text as its tokens arrive: each piece safe to send, and the whole text cut at a stop
string. Pure (a tokenizer in, strings out), so that the stream and the whole answer agree:

    pieces = [s.feed(step_tokens) for step_tokens in steps] + [s.finish()]
    "".join(pieces) == s.text == stop_cut(tokenizer.decode(all_tokens))

Terms: *sent* is the text handed out so far; a piece is held back while the decoded text ends in an
incomplete UTF-8 character (a byte-level token decodes to U+FFFD until its character's last byte
comes), or while its tail could still begin a stop string (OpenAI's ``stop`` is not part of the
answer, so no character of it may have been sent).
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


def stop_cut(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to its first stop string, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class TextStream:
    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # characters that may be a stop's beginning
        self.tokens: list[int] = []
        self.sent = ""
        # incremental decoding (vLLM's offsets): only the tokens from ``_prefix`` on are decoded again, since
        # a step's tokens can change how the last few decode (a character's bytes split across tokens)
        self._decoded, self._prefix, self._read = "", 0, 0

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def _decode_new(self) -> str:
        """The whole text so far, decoding only the tail: a step costs the same however long the text."""
        decode = self.tokenizer.decode
        before = decode(self.tokens[self._prefix:self._read], skip_special_tokens=True)
        now = decode(self.tokens[self._prefix:], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            self._decoded += now[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)
        return self._decoded

    def feed(self, tokens: list[int]) -> str:
        """The new text safe to send after ``tokens`` (possibly empty)."""
        self.tokens.extend(tokens)
        text, stopped = stop_cut(self._decode_new(), self.stops)
        if not stopped:
            text = text.rstrip(REPLACEMENT)
            text = text[: max(0, len(text) - self.hold)]
        return self._advance(text)

    def finish(self) -> str:
        """The rest of the text, once the sequence has ended."""
        return self._advance(self.text)

    @property
    def text(self) -> str:
        return stop_cut(self._decode(), self.stops)[0]

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new; or a decoding that rewrote what was sent, which later text settles
        piece, self.sent = text[len(self.sent):], text
        return piece
