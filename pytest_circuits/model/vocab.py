"""Which token ids the probes may draw, and whether the model wants a BOS token first.

With a tokenizer in the model folder: ordinary ids are those below ``vocab_size`` that
the tokenizer does not call special, and BOS is prepended when the tokenizer itself
prepends it. Without one (token ids only): every id in ``[0, vocab_size)`` not named
special in the config is ordinary, and no BOS is prepended (docs/definitions.md, "The random-repeat probe").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelLoadError, first_line
from ..fsio import JsonUnreadable, read_json
from ..options import flag

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
CONFIG_SPECIAL_ATTRS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id")


@dataclass(frozen=True)
class TokenInfo:
    """Token range facts that fix the probe's tokens."""

    vocab_size: int
    special_ids: tuple[int, ...]
    bos_id: int | None  # prepended to every probe sequence when not None
    has_tokenizer: bool

    def ordinary_ids(self) -> np.ndarray:
        """Sorted ids the probe samples from."""
        ids = np.arange(self.vocab_size, dtype=np.int64)
        special = [i for i in self.special_ids if 0 <= i < self.vocab_size]
        return np.setdiff1d(ids, np.asarray(special, dtype=np.int64))


def _config_special_ids(config) -> set[int]:
    found: set[int] = set()
    for attr in CONFIG_SPECIAL_ATTRS:
        value = getattr(config, attr, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        found.update(int(v) for v in values if isinstance(v, int))
    return found


def remote_code_file(folder: Path) -> str | None:
    """The file that maps the tokenizer to the folder's own code (``auto_map``), or None."""
    for name, needs in (("tokenizer_config.json", None), ("config.json", "AutoTokenizer")):
        try:
            data = read_json(folder / name)
        except JsonUnreadable as error:
            if error.missing:
                continue
            raise ModelLoadError(
                f"model folder {folder}: {name} {error.reason}; fix it or save the model again"
            ) from None
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if auto_map and (needs is None or not isinstance(auto_map, dict) or needs in auto_map):
            return name
    return None


def token_info(folder: Path, config, trust_remote_code: bool = False) -> TokenInfo:
    """Token facts of the model in ``folder`` (tokenizer if present, else config).

    A tokenizer that needs the folder's own code (``auto_map``) is refused unless
    ``trust_remote_code``; a BOS id the embedding cannot look up is refused.
    """
    vocab = int(config.vocab_size)
    folder = Path(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return TokenInfo(vocab, tuple(sorted(_config_special_ids(config))), None, False)
    remote = remote_code_file(folder)
    if remote and not trust_remote_code:
        raise ModelLoadError(
            f"the tokenizer of {folder} runs the folder's own code ({remote} has auto_map); nothing was imported: "
            f"pass {flag('trust-remote-code')} only if you trust it"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as error:  # transformers and tokenizers raise many kinds here
        raise ModelLoadError(f"the tokenizer of {folder} cannot be loaded: {first_line(error)}") from None
    special = set(tokenizer.all_special_ids) | _config_special_ids(config)
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    bos = tokenizer.bos_token_id
    probe_ids = tokenizer("a b")["input_ids"]
    uses_bos = bos is not None and len(probe_ids) > 0 and probe_ids[0] == bos
    if uses_bos and not 0 <= bos < vocab:
        raise ModelLoadError(
            f"the tokenizer of {folder} prepends BOS id {bos}, outside the model's vocabulary "
            f"(vocab_size {vocab}); fix bos_token_id in the tokenizer or vocab_size in config.json"
        )
    return TokenInfo(vocab, tuple(sorted(special)), bos if uses_bos else None, True)
