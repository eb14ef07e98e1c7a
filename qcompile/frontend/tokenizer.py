"""Text in and out: the checkpoint's `tokenizer.json` read with Hugging Face's `tokenizers` library, and the small
real tokenizer `init-tiny` writes beside a generated checkpoint.

A Hugging Face checkpoint ships its tokenizer as `tokenizer.json` beside `config.json`; `run --prompt`, `check` and
(later) `serve` encode text with it and decode the generated ids. A generated checkpoint has random weights, so its
text is nonsense, but the path from text to ids and back is the real one: init-tiny trains a byte-level BPE
tokenizer on the bundled text below (deterministic: the same file every time), with <pad>, <s>, </s> at the ids the
generated config uses (0, 1, 2; </s> is its eos_token_id), so the README's first command shows text generation.
"""

from __future__ import annotations

from pathlib import Path

from qcompile.errors import UsageError

TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: pad, bos, eos of the generated configs

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


def decode(tokenizer, ids: list[int]) -> str:
    """The text of generated ids; an id the tokenizer does not have (a model vocabulary larger than the
    tokenizer's) shows as <id N>."""
    size = tokenizer.get_vocab_size()
    parts, run = [], []
    for token in ids:
        if 0 <= token < size:
            run.append(token)
            continue
        if run:
            parts.append(tokenizer.decode(run, skip_special_tokens=False))
            run = []
        parts.append(f"<id {token}>")
    if run:
        parts.append(tokenizer.decode(run, skip_special_tokens=False))
    return "".join(parts)
