"""The own-text probe (docs/definitions.md, "The own-text probe"): the repeat probe's shape on a team's own text.

The file's text becomes one stream of ``T`` ids: the model's tokenizer with no special token, or, for the
embedded tiny-induction (no tokenizer), `audit.word_id` of each whitespace-separated word. The stream is
cut into ``P = floor(T / L)`` consecutive passages of ``L`` ids; ``numpy.random.Generator(PCG64(seed))
.choice(P, n, replace=False)`` picks ``n`` of them, in the order drawn; each is followed by its exact
copy, BOS prepended where the model wants one: ``[BOS] x x``, the random-repeat probe's shape, so every
figure of the probe and the knockouts (copy loss, routing scores, deltas) is defined as there.

`probe_ids` is the one place the probe's and the knockouts' sequences come from.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

from ..model.loading import ModelSource
from ..model.vocab import TokenInfo
from ..options import flag
from .repeat import repeat_tokens, repeated
from .repeat_settings import ProbeText, ProbeTextError, RepeatSettings


@functools.lru_cache(maxsize=4)
def text_stream(source: ModelSource, tokens: TokenInfo, text: ProbeText) -> tuple[str, np.ndarray]:
    """``(kind, ids)``: how the model reads text (`audit.TOKENS_TOKENIZER` or `audit.TOKENS_WORDS`) and
    the int64 ids of the whole file; a model with neither a tokenizer nor the embedded word ids is one line."""
    from .audit import text_ids

    reader = text_ids(source, tokens, text.trust_remote_code, "the own-text probe reads text", ProbeTextError)
    return reader.kind, np.asarray(reader.plain(text.text), dtype=np.int64)


def text_passages(stream: np.ndarray, text: ProbeText, n: int, L: int, seed: int) -> np.ndarray:
    """``(n, L)`` ids: ``n`` of the stream's ``floor(T / L)`` passages drawn with ``seed``; a text too short
    for ``n`` passages is one line saying how many tokens it has and how many are needed."""
    count = stream.size // L
    if count < n:
        raise ProbeTextError(
            f"{flag('probe-text')} {text.path}: {stream.size} tokens, but n={n} passages of L={L} need {n * L}; "
            f"give a longer text or lower {flag('probe-n')} or {flag('probe-length')}"
        )
    rng = np.random.Generator(np.random.PCG64(seed))
    chosen = rng.choice(count, size=n, replace=False)
    return np.stack([stream[i * L : (i + 1) * L] for i in chosen])


def text_repeat_tokens(source: ModelSource, tokens: TokenInfo, settings: RepeatSettings) -> torch.Tensor:
    """``(n, 2L [+1])`` int64 ids ``[BOS] x x`` with ``x`` a seeded passage of the settings' text."""
    assert settings.text is not None, "not an own-text probe"
    _, stream = text_stream(source, tokens, settings.text)
    return repeated(text_passages(stream, settings.text, settings.n, settings.L, settings.seed), tokens.bos_id)


def probe_ids(source: ModelSource, tokens: TokenInfo, settings: RepeatSettings) -> torch.Tensor:
    """The probe's ``(n, 2L [+1])`` sequences: the own-text probe's passages when the settings name a text,
    else the random-repeat probe's uniform ids (`repeat.repeat_tokens`)."""
    if settings.text is None:
        return repeat_tokens(tokens, settings.n, settings.L, settings.seed)
    return text_repeat_tokens(source, tokens, settings)


def text_identity(source: ModelSource, tokens: TokenInfo, settings: RepeatSettings) -> dict:
    """The record's ``text`` of an own-text probe (``{}`` for the random one): the file's name and sha256,
    how the model read it (``tokens``) and the sha256 of the probe's ids (the tokenizer's part of it)."""
    if settings.text is None:
        return {}
    kind, _ = text_stream(source, tokens, settings.text)
    ids = text_repeat_tokens(source, tokens, settings).numpy()
    digest = hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").tobytes()).hexdigest()
    return {"text": {**settings.text.as_dict(), "tokens": kind, "ids_sha256": digest}}


def check_probe_text(source: ModelSource, tokens: TokenInfo, *settings: RepeatSettings) -> None:
    """Before any weight loads (the run's preflight): the text is read by this model and holds the
    passages each of ``settings`` draws (the probe's, the knockouts'); else one line."""
    for one in settings:
        if one.text is not None:
            text_repeat_tokens(source, tokens, one)
