"""Text in and out: the checkpoint's `tokenizer.json` read with Hugging Face's `tokenizers` library, and the small
real tokenizer `init-tiny` writes beside a generated checkpoint.

A Hugging Face checkpoint ships its tokenizer as `tokenizer.json` beside `config.json`; `run --prompt`, `check` and
`serve` encode text with it and decode the generated ids. A generated checkpoint has random weights, so its
text is nonsense, but the path from text to ids and back is the real one: init-tiny trains a byte-level BPE
tokenizer on the bundled text below (deterministic: the same file every time), with <pad>, <s>, </s> at the ids the
generated config uses (0, 1, 2; </s> is its eos_token_id), so the README's first command shows text generation.
"""

from __future__ import annotations

from pathlib import Path

from qcompile.errors import UsageError

TOKENIZER_FILE = "tokenizer.json"
#: The files an artifact copies from the checkpoint so text and chat prompts work on it alone (frontend/chat.py).
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "chat_template.jinja")
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: pad, bos, eos of the generated configs
#: tokenizer_config.json beside the tiny tokenizer: its special tokens, and the class transformers loads it with.
TINY_TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<s>",
                         "eos_token": "</s>", "model_max_length": 4096}

#: The bundled training text (written for qcompile; any English prose would do).
CORPUS = """\
A compiler reads a program in one form and writes it in another, keeping what it means while changing how it runs.
qcompile reads a language model as a Hugging Face checkpoint, lowers it into a small graph of operations, and
rewrites that graph with passes: each pass is a name, a summary and a function from one graph to another, and the
pass manager checks every result against the graph it started from before the next pass may run. When the numbers
agree within the bound of the pass, the pipeline goes on; when they do not, it stops, names the pass, and writes a
reproducer that fails the same way on another machine.
The model is a mixture of experts. Every token chooses a few experts out of many, and only those experts run for
it; a shared expert runs for every token. Three layers in four are linear attention, a gated delta rule that keeps
a fixed state per sequence instead of a cache that grows; the fourth is ordinary attention over a paged cache.
Serving such a model means keeping many sequences in flight at once: new requests arrive while others finish,
prompts are read in chunks while earlier requests generate one token at a time, and pages of the cache are lent
and returned as sequences come and go. On a mesh of devices the experts are spread over the devices, the tokens
are gathered where their experts live, and the results are scattered back; on two levels of devices the local
step comes first, so that less crosses the slow link.
The weights stay where they were mapped, the caches stay on the device, and only token ids come back to the host.
Tests compare every kernel with a reference written plainly, and the whole model with the framework it came from.
"""


def train_tiny_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of at most `vocab_size` ids trained on CORPUS (special tokens first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tokenizer


def load_tokenizer(directory: Path | None, what: str):
    """The tokenizer in `directory` (a checkpoint's or an artifact's); a usage error naming `what` needs it when
    there is none."""
    file = None if directory is None else Path(directory) / TOKENIZER_FILE
    if file is None or not file.is_file():
        raise UsageError(f"{what} needs the checkpoint's {TOKENIZER_FILE}, which {directory} does not have; give "
                         "token ids instead")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - the library raises its own exception types
        raise UsageError(f"{file}: not a tokenizer the tokenizers library can read ({err})") from None


def decode(tokenizer, ids: list[int], skip_special: bool = False) -> str:
    """The text of generated ids; an id the tokenizer does not have (a model vocabulary larger than the
    tokenizer's) shows as <id N>. `skip_special` drops special tokens (<s>, </s>, ...), as a server's text does."""
    size = tokenizer.get_vocab_size()
    parts, run = [], []
    for token in ids:
        if 0 <= token < size:
            run.append(token)
            continue
        if run:
            parts.append(tokenizer.decode(run, skip_special_tokens=skip_special))
            run = []
        parts.append(f"<id {token}>")
    if run:
        parts.append(tokenizer.decode(run, skip_special_tokens=skip_special))
    return "".join(parts)


class TextStream:
    """Generated ids → text, a piece at a time, with stop strings: what a streaming server sends.

    Two things make the text of one more token more than decode([token]): a byte-level BPE token may hold part of a
    UTF-8 character (its text is U+FFFD until the rest arrives), and a merge may decode differently next to its left
    neighbour. So each piece is the text of a short window of recent ids minus the text of the window without the
    new ones (the window moves on once a piece is complete, as vLLM's incremental detokenizer does): linear in the
    output, not quadratic. Stop strings: text is held back while its end could still be the start of a stop string;
    when one appears, the text ends just before it and `stopped` is set. Special tokens (eos) show no text.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (may run past a stop string)
        self.sent = 0  # how much of `text` has been handed out
        self.stopped = False
        self._prefix = self._read = 0  # window: ids[_prefix:_read] is decoded context, ids[_read:] is pending

    def _decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids, skip_special=True)

    def push(self, token: int) -> str:
        """Add one generated id; returns the text that may be sent now ("" while held back or after a stop)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once generation has ended (an incomplete character shows as U+FFFD)."""
        if not self.stopped and self._read < len(self.ids):
            before = self._decode(self.ids[self._prefix:self._read])
            self.text += self._decode(self.ids[self._prefix:])[len(before):]
            self._prefix = self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        longest = max((len(s) for s in self.stops), default=0)
        hits = [i for i in (self.text.find(s, max(0, self.sent - longest + 1)) for s in self.stops) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        elif final:
            end = len(self.text)
        else:  # hold back a tail that a stop string could still start with
            end = len(self.text) - max((k for s in self.stops for k in range(min(len(s) - 1, len(self.text)), 0, -1)
                                        if self.text.endswith(s[:k])), default=0)
        piece = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece


def _byte_level_alphabet() -> dict[str, int]:
    """The printable character a byte-level BPE vocabulary writes for each byte (GPT-2's table): printable Latin-1
    stands for itself, the other bytes for 256, 257, ... in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


class TokenStrings:
    """Each token id's own bytes and text, as servers report tokens in `logprobs` (OpenAI's `token` and `bytes`).

    A byte-level BPE token (Qwen's tokenizers) is a run of bytes that may end inside a UTF-8 character: its bytes
    come from the vocabulary's spelling through the byte alphabet, and its text is those bytes decoded with U+FFFD
    for an incomplete character (what decode([id]) gives). A special or added token is its content; any other
    tokenizer's token is decode([id]). An id past the tokenizer's vocabulary is `token_id:N` (vLLM's spelling) with
    no bytes. Cached per id: a server asks for the same few thousand tokens again and again."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.size = tokenizer.get_vocab_size()
        self.added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
        self.alphabet = _byte_level_alphabet() if self.byte_level else {}
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def _bytes(self, token: int) -> bytes:
        if token in self.added:
            return self.added[token].encode("utf-8")
        spelling = self.tokenizer.id_to_token(token)
        if self.byte_level and spelling is not None and all(c in self.alphabet for c in spelling):
            return bytes(self.alphabet[c] for c in spelling)
        return self.tokenizer.decode([token], skip_special_tokens=False).encode("utf-8")

    def __call__(self, token: int) -> tuple[str, list[int] | None]:
        """(text, bytes) of one token id."""
        found = self._cache.get(token)
        if found is None:
            if 0 <= token < self.size:
                raw = self._bytes(token)
                found = (raw.decode("utf-8", errors="replace"), list(raw))
            else:
                found = (f"token_id:{token}", None)
            if len(self._cache) < 1 << 20:
                self._cache[token] = found
        return found
