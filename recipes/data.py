"""Text corpora, tokenizers and packed token sequences for the pretraining recipes.

1. Corpus (``load_corpus``): a text file, a folder of files (read recursively, hidden
   files and folders skipped, sorted by path), or JSONL (``*.jsonl``: one JSON object per
   line, text under ``text_field``). Without a path: this machine's Python standard
   library sources (nothing is downloaded), capped at ``max_bytes``.
2. Tokenizer (``get_tokenizer``): a local ``tokenizer.json``, or one trained on the corpus
   with the ``tokenizers`` library (WordPiece for BERT, byte-level BPE for GPT-2) and
   cached, keyed by the corpus digest and the settings. ``fingerprint`` identifies it in
   checkpoints.
3. Token ids (``encode``): the corpus encoded once (cached as well), documents kept apart
   in a ``TokenStream``; ``TokenStream.split`` holds out the tail for evaluation.
4. Packing: ``causal_sequences`` (documents joined by EOS and cut into equal rows, GPT-2)
   and ``document_chunks`` (each document cut into rows of at most n tokens, BERT).
5. ``EpochSampler``: position k of an endless index stream is a pure function of
   (seed, k) -- one seeded permutation per epoch -- so resuming needs only the position.

Every problem with the input raises ``RecipeError`` naming the file and what is wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ortrain.recipes import RecipeError
from ortrain.safe_files import atomic_write

GPT2_EOS = "<|endoftext|>"
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
TOKENIZER_KINDS = {"bpe": (GPT2_EOS,), "wordpiece": BERT_SPECIALS}
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# ----------------------------------------------------------------------------- corpus
@dataclasses.dataclass(frozen=True)
class Corpus:
    texts: list[str]  # one entry per document
    source: str  # what was read, for messages
    digest: str  # sha256 over the documents: the cache key of tokenizer and token ids

    @property
    def num_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.texts)


def stdlib_sources() -> Iterator[Path]:
    """The standard library's ``*.py`` files: top level first, then its packages (tests
    and installed third-party packages left out), each sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    yield from sorted(root.glob("*.py"))
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        if Path(dirpath) != root:
            yield from (Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RecipeError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(
            f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        ) from exc


def _read_jsonl(path: Path, text_field: str) -> list[str]:
    texts = []
    for lineno, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecipeError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise RecipeError(f"{path}:{lineno}: no string field '{text_field}'")
        texts.append(record[text_field])
    return texts


def _files_under(folder: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files += [Path(dirpath) / f for f in sorted(filenames) if not f.startswith(".")]
    return files


def _digest(texts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        data = t.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def load_corpus(
    path: str | os.PathLike | None, *, text_field: str = "text", max_bytes: int | None = None
) -> Corpus:
    """Documents from ``path`` (file, folder or JSONL), or the stdlib sources if None.

    ``max_bytes`` caps the default corpus: whole files are taken in order until the cap
    is reached."""
    if path is None:
        texts, total = [], 0
        for f in stdlib_sources():
            try:
                text = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue  # the default corpus skips what it cannot read
            texts.append(text)
            total += len(text.encode())
            if max_bytes is not None and total >= max_bytes:
                break
        source = f"Python {sysconfig.get_python_version()} standard library sources"
        if not texts:
            raise RecipeError(f"no readable {source} under {sysconfig.get_paths()['stdlib']}")
        texts = [t for t in texts if t.strip()]
        return Corpus(texts, source, _digest(texts))
    p = Path(path)
    if not p.exists():
        raise RecipeError(f"data path {p} does not exist")
    files = _files_under(p) if p.is_dir() else [p]
    texts = []
    for f in files:
        if f.suffix == ".jsonl":
            texts += _read_jsonl(f, text_field)
        else:
            texts.append(_read_text(f))
    texts = [t for t in texts if t.strip()]
    if not texts:
        what = "folder with no non-empty files" if p.is_dir() else "empty"
        raise RecipeError(f"no text in {p} ({what})")
    return Corpus(texts, str(p), _digest(texts))


# ----------------------------------------------------------------------------- tokenizer
def describe(corpus: Corpus, tokenizer: Tokenizer, how: str) -> list[str]:
    """The corpus and tokenizer lines of a recipe's header."""
    return [
        f"corpus: {corpus.source}, {len(corpus.texts)} documents, {corpus.num_bytes / 1e6:.2f} MB",
        f"tokenizer: {how} (fingerprint {fingerprint(tokenizer)})",
    ]


def fingerprint(tokenizer: Tokenizer) -> str:
    """A short hash of the tokenizer's full serialization (vocabulary, merges, rules)."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]


def train_tokenizer(texts: list[str], kind: str, vocab_size: int) -> Tokenizer:
    """WordPiece (BERT: case kept, since code is case-sensitive) or byte-level BPE (GPT-2)."""
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=False)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size, special_tokens=list(BERT_SPECIALS), show_progress=False
        )
    elif kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[GPT2_EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if kind == "wordpiece":
        # The trainer numbers equally frequent pieces in hash order, which varies from run
        # to run; WordPiece matching does not depend on ids, so renumber canonically.
        vocab = tok.get_vocab()
        order = list(BERT_SPECIALS) + sorted(set(vocab) - set(BERT_SPECIALS))
        tok.model = models.WordPiece({t: i for i, t in enumerate(order)}, unk_token="[UNK]")
    return tok


def load_tokenizer(path: str | os.PathLike, kind: str) -> Tokenizer:
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"tokenizer file {p} does not exist")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RecipeError(f"cannot load tokenizer {p}: {first}") from exc
    missing = [t for t in TOKENIZER_KINDS[kind] if tok.token_to_id(t) is None]
    if missing:
        need = ", ".join(TOKENIZER_KINDS[kind])
        raise RecipeError(f"tokenizer {p} has no {missing} token(s); this recipe needs {need}")
    return tok


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ortrain" / "recipes"


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(f)`` into a new temporary file, then renamed (``ortrain/safe_files.py``):
    concurrent processes (torchrun ranks) never see a half-written cache file, and a link
    planted at a predictable temporary name is never followed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, write)


def get_tokenizer(
    path: str | os.PathLike | None,
    corpus: Corpus,
    kind: str,
    vocab_size: int,
    cache: Path | None = None,
) -> tuple[Tokenizer, str]:
    """The tokenizer at ``path``, else the one trained on ``corpus`` (from the cache if it
    was trained before). Returns it and a description for the log."""
    if path is not None:
        return load_tokenizer(path, kind), f"loaded from {path}"
    cached = (
        (cache or cache_dir()) / "tokenizers" / f"{kind}-{vocab_size}-{corpus.digest[:16]}.json"
    )
    if cached.is_file():
        return load_tokenizer(cached, kind), f"{kind} {vocab_size}, cached at {cached}"
    tok = train_tokenizer(corpus.texts, kind, vocab_size)
    _atomic_write(cached, lambda f: f.write(tok.to_str(pretty=True).encode()))
    return tok, f"{kind} {vocab_size}, trained on the corpus, cached at {cached}"


# ----------------------------------------------------------------------------- token ids
@dataclasses.dataclass(frozen=True)
class TokenStream:
    """All documents' token ids back to back; document d is ``ids[starts[d]:starts[d+1]]``."""

    ids: np.ndarray  # int32 [T]
    starts: np.ndarray  # int64 [D + 1], starts[0] = 0, starts[-1] = T

    def __len__(self) -> int:
        return len(self.ids)

    def documents(self) -> list[np.ndarray]:
        return [self.ids[a:b] for a, b in zip(self.starts[:-1], self.starts[1:]) if b > a]

    def split(self, eval_fraction: float) -> tuple[TokenStream, TokenStream]:
        """(train, held out): the held-out part is the last ``eval_fraction`` of the
        tokens; a document that straddles the cut is split in two."""
        cut = len(self) - round(len(self) * eval_fraction)

        def part(a: int, b: int) -> TokenStream:
            starts = np.clip(self.starts, a, b) - a
            return TokenStream(self.ids[a:b], np.unique(starts))

        return part(0, cut), part(cut, len(self))


def encode(tokenizer: Tokenizer, corpus: Corpus, cache: Path | None = None) -> TokenStream:
    """The corpus's token ids (no special tokens added), cached by tokenizer and corpus."""
    key = f"{fingerprint(tokenizer)}-{corpus.digest[:16]}.npz"
    cached = (cache or cache_dir()) / "tokens" / key
    if cached.is_file():
        with np.load(cached) as z:
            return TokenStream(z["ids"], z["starts"])
    encodings = tokenizer.encode_batch(corpus.texts, add_special_tokens=False)
    lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int32, count=starts[-1])
    _atomic_write(cached, lambda f: np.savez(f, ids=ids, starts=starts))
    return TokenStream(ids, starts)


# ----------------------------------------------------------------------------- packing
def causal_sequences(stream: TokenStream, seq_len: int, eos_id: int) -> torch.Tensor:
    """Documents each followed by EOS, concatenated and cut into rows of ``seq_len``
    (the tail that does not fill a row is dropped): int64 [N, seq_len]."""
    eos = np.array([eos_id], dtype=np.int32)
    joined = np.concatenate([x for d in stream.documents() for x in (d, eos)] or [eos[:0]])
    n = len(joined) // seq_len
    return torch.from_numpy(joined[: n * seq_len].astype(np.int64)).view(n, seq_len)


@dataclasses.dataclass(frozen=True)
class Chunks:
    """Pieces of documents, at most ``ids.shape[1]`` tokens each, right-padded with 0."""

    ids: torch.Tensor  # int64 [N, n]
    lengths: torch.Tensor  # int64 [N]
    doc: torch.Tensor  # int64 [N]: which document each piece comes from

    def __len__(self) -> int:
        return len(self.lengths)


def document_chunks(stream: TokenStream, max_len: int, min_len: int = 1) -> Chunks:
    """Each document cut into consecutive pieces of ``max_len`` tokens (its last piece
    shorter); pieces under ``min_len`` tokens are dropped."""
    rows, lengths, docs = [], [], []
    for d, doc in enumerate(stream.documents()):
        for a in range(0, len(doc), max_len):
            piece = doc[a : a + max_len]
            if len(piece) >= min_len:
                rows.append(np.pad(piece, (0, max_len - len(piece))))
                lengths.append(len(piece))
                docs.append(d)
    ids = np.stack(rows).astype(np.int64) if rows else np.zeros((0, max_len), np.int64)
    return Chunks(
        torch.from_numpy(ids),
        torch.tensor(lengths, dtype=torch.int64),
        torch.tensor(docs, dtype=torch.int64),
    )


class EpochSampler:
    """Indices into ``n`` items as an endless stream: position k belongs to epoch k // n,
    which visits a permutation seeded by (seed, epoch)."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError("EpochSampler needs at least one item")
        self.n, self.seed = n, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.clear()
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=g)
        return self._perms[epoch]

    def take(self, start: int, count: int) -> torch.Tensor:
        """The indices at stream positions ``start .. start + count - 1``."""
        return torch.stack(
            [self._perm(k // self.n)[k % self.n] for k in range(start, start + count)]
        )
