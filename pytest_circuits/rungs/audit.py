"""Rung 3 on an audit slice (docs/audit.md, docs/definitions.md "Rung 3: document counterfactuals").

For a case with chunks ``c_0 .. c_{N-1}``, prompt ``P(S)`` (the template with the chunks of ``S``)
and answer tokens ``a_1 .. a_m`` (tokenized on their own, so they are the same whatever is removed),
under teacher forcing, deterministic (no sampling):

- answer log-probability ``lp(S) = sum_j ln p(a_j | P(S), a_<j)``; the record keeps ``lp(all)``;
- the drop of chunk ``i``: ``drop_i = lp(all) - lp(all \\ {i})`` (nats; positive: removing it hurts);
- the cited drop: ``lp(all) - lp(all \\ cited)`` (the cases that name cited chunks);
- the top chunk: ``argmax_i drop_i`` (the lowest index on a tie).

N + 1 forwards per case (one more when more than one chunk is cited), right-padded in batches of
at most ``batch_size`` sequences with an attention mask; a bitsandbytes LLM.int8() build, whose
outlier columns are picked per batch, runs one sequence per forward.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import CircuitsError
from ..model.builds import LoadedBuild
from ..model.loading import ModelSource
from ..model.named import named_model_path
from ..model.quantized_cache import refuse_decode_only
from ..model.vocab import TokenInfo
from .audit_slice import AuditCase, AuditSlice, AuditSliceError
from .repeat import context_length

ANSWER_SEPARATOR = " "  # the answer is tokenized as ANSWER_SEPARATOR + answer, after the prompt's tokens
TOKENS_TOKENIZER = "tokenizer"  # the model's own tokenizer
TOKENS_WORDS = "words"  # the embedded model's word ids (`word_id`)


def word_id(word: str, vocab: int) -> int:
    """The embedded model's id of one whitespace-separated word: the first 8 bytes of its UTF-8 sha256,
    big-endian, mod ``vocab`` (the model has no tokenizer; its induction circuit copies ids)."""
    return int.from_bytes(hashlib.sha256(word.encode("utf-8")).digest()[:8], "big") % vocab


@dataclass(frozen=True)
class TextIds:
    """How a build's text becomes ids: ``kind`` (`TOKENS_TOKENIZER` or `TOKENS_WORDS`) and the encoders."""

    kind: str
    prompt: Callable[[str], list[int]]  # the prompt's ids, BOS first where the model wants it
    answer: Callable[[str], list[int]]  # the answer's ids, no special token
    plain: Callable[[str], list[int]]  # a text's ids as they stand, no special token (the own-text probe's)


def text_ids(
    source: ModelSource,
    tokens: TokenInfo,
    trust_remote_code: bool = False,
    needs: str = "an audit slice is text",
    error: type[CircuitsError] = AuditSliceError,
) -> TextIds:
    """The model's `TextIds`: its tokenizer, else (the embedded model only) `word_id` per word; a model
    with neither is one line (``error``), saying what ``needs`` text."""
    if tokens.has_tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            str(source.folder), local_files_only=True, trust_remote_code=trust_remote_code
        )
        return TextIds(
            TOKENS_TOKENIZER,
            lambda text: list(tokenizer(text)["input_ids"]),
            lambda text: list(tokenizer(ANSWER_SEPARATOR + text, add_special_tokens=False)["input_ids"]),
            lambda text: list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]),
        )
    embedded = named_model_path("tiny-induction")
    if embedded is None or source.folder.resolve() != embedded.resolve():
        raise error(
            f"model {source.name} has no tokenizer, and {needs}: give the model folder with "
            "its tokenizer (only the embedded tiny-induction reads words as ids, docs/audit.md)"
        )
    vocab = tokens.vocab_size

    def words(text: str) -> list[int]:
        return word_ids(text, vocab)

    return TextIds(TOKENS_WORDS, words, words, words)


def word_ids(text: str, vocab: int) -> list[int]:
    """The embedded model's ids of ``text``: `word_id` of each whitespace-separated word."""
    return [word_id(w, vocab) for w in text.split()]


@dataclass(frozen=True)
class CaseFigures:
    """Rung 3 of one case on one build (nats)."""

    id: str
    answer_tokens: int
    answer_logprob: float
    chunk_drops: tuple[float, ...]
    cited: tuple[int, ...] | None
    cited_drop: float | None

    @property
    def top_chunk(self) -> int:
        """The chunk whose removal lowers the answer's log-probability most (the lowest index on a tie)."""
        return max(range(len(self.chunk_drops)), key=lambda i: (self.chunk_drops[i], -i))

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "answer_tokens": self.answer_tokens,
            "answer_logprob": self.answer_logprob,
            "chunk_drops": list(self.chunk_drops),
            "cited": None if self.cited is None else list(self.cited),
            "cited_drop": self.cited_drop,
            "top_chunk": self.top_chunk,
        }


def case_prompts(case: AuditCase) -> list[tuple[int, ...]]:
    """The kept chunks of each forward of a case: every chunk, then each one removed, then (when more
    than one chunk is cited) every cited one removed."""
    every = tuple(range(len(case.chunks)))
    kept = [every] + [tuple(j for j in every if j != i) for i in every]
    if case.cited is not None and len(case.cited) > 1:
        kept.append(tuple(j for j in every if j not in case.cited))
    return kept


def case_sequences(case: AuditCase, ids: TextIds, where: str, limit: int | None) -> tuple[list[list[int]], int]:
    """``(sequences, m)``: the ids of each forward of `case_prompts` (prompt then answer) and the answer's
    length; a blank answer or a prompt over the model's context is one line naming ``where``."""
    answer = ids.answer(case.answer)
    if not answer:
        raise AuditSliceError(f"{where}: answer {case.answer!r} has no tokens; give a non-empty answer")
    sequences = [ids.prompt(case.prompt(kept)) + answer for kept in case_prompts(case)]
    if limit is not None and len(sequences[0]) > limit:
        raise AuditSliceError(
            f"{where}: prompt and answer are {len(sequences[0])} tokens, over the model's context of {limit}; "
            "shorten the case's chunks or split it"
        )
    return sequences, len(answer)


@torch.no_grad()
def answer_logprobs(model: torch.nn.Module, sequences: Sequence[list[int]], m: int, rows: int, device) -> list[float]:
    """``sum_j ln p(a_j | ...)`` of the last ``m`` ids of each sequence, right-padded ``rows`` at a time
    (attention mask on the padding; each sequence's positions are its own 0..T-1)."""
    out: list[float] = []
    for start in range(0, len(sequences), rows):
        batch = sequences[start : start + rows]
        width = max(len(s) for s in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, s in enumerate(batch):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        for r, s in enumerate(batch):
            T = len(s)
            logp = torch.log_softmax(logits[r, T - m - 1 : T - 1].double(), dim=-1)
            targets = torch.tensor(s[T - m :], device=logp.device)
            out.append(float(logp.gather(1, targets[:, None]).sum()))
    return out


def case_figures(build: LoadedBuild, case: AuditCase, ids: TextIds, where: str, rows: int) -> CaseFigures:
    """Rung 3 of one case (module docstring)."""
    sequences, m = case_sequences(case, ids, where, context_length(build.model.config))
    lps = answer_logprobs(build.model, sequences, m, 1 if build.llm_int8 else rows, build.device)
    full, drops = lps[0], tuple(lps[0] - lp for lp in lps[1 : 1 + len(case.chunks)])
    cited_drop = None
    if case.cited is not None:
        cited_drop = drops[case.cited[0]] if len(case.cited) == 1 else full - lps[-1]
    return CaseFigures(case.id, m, full, drops, case.cited, cited_drop)


@dataclass(frozen=True)
class AuditFigures:
    """Rung 3 of a slice on one build: the slice's identity and each case's figures."""

    slice_sha256: str
    slice_name: str
    tokens: str
    cases: tuple[CaseFigures, ...]

    @classmethod
    def from_section(cls, section: dict) -> AuditFigures:
        """The figures back from their `section` (a shard's, written once per run under pytest-xdist)."""
        cases = tuple(
            CaseFigures(
                c["id"],
                c["answer_tokens"],
                c["answer_logprob"],
                tuple(c["chunk_drops"]),
                None if c["cited"] is None else tuple(c["cited"]),
                c["cited_drop"],
            )
            for c in section["cases"]
        )
        return cls(section["slice_sha256"], section["slice_name"], section["tokens"], cases)

    @classmethod
    def merged(cls, parts: Sequence[AuditFigures]) -> AuditFigures:
        """The figures of a whole slice from its shards' (`case_shards`), in order."""
        first = parts[0]
        return cls(first.slice_sha256, first.slice_name, first.tokens, tuple(c for p in parts for c in p.cases))

    def section(self) -> dict:
        """The record's ``audit`` section (`record.audit.AuditInfo`)."""
        return {
            "slice_sha256": self.slice_sha256,
            "slice_name": self.slice_name,
            "n_cases": len(self.cases),
            "tokens": self.tokens,
            "cases": [c.as_dict() for c in self.cases],
        }


def case_shards(n_cases: int, k: int) -> list[range]:
    """``k`` contiguous runs of case indices covering ``0 .. n_cases-1``, sizes differing by one at most."""
    bounds = [round(i * n_cases / k) for i in range(k + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(k)]


def audit_figures(
    build: LoadedBuild,
    audit: AuditSlice,
    batch_size: int = 8,
    trust_remote_code: bool = False,
    cases: range | None = None,
) -> AuditFigures:
    """Rung 3 of every case of ``audit`` on ``build`` (`case_figures`), or of the cases at indices ``cases`` (a shard)."""
    refuse_decode_only(build, "the audit slice")
    ids = text_ids(build.source, build.tokens, trust_remote_code)
    chosen = audit.cases if cases is None else audit.cases[cases.start : cases.stop]
    measured = tuple(case_figures(build, case, ids, audit.where(case), batch_size) for case in chosen)
    for case, figures in zip(chosen, measured):
        if not math.isfinite(figures.answer_logprob):
            raise AuditSliceError(f"{audit.where(case)}: the answer's log-probability is not finite on {build.label}")
    return AuditFigures(audit.sha256, audit.path.name, ids.kind, measured)


def check_slice(
    source: ModelSource, config, tokens: TokenInfo, audit: AuditSlice, trust_remote_code: bool = False
) -> None:
    """Before any weight loads (the run's preflight): every case of ``audit`` becomes ids this model reads,
    with an answer of at least one token and every prompt within the model's context; else one line."""
    ids = text_ids(source, tokens, trust_remote_code)
    for case in audit.cases:
        case_sequences(case, ids, audit.where(case), context_length(config))
