"""Per-head weights of every layer, float32, dequantized, optionally norm-folded.

Row-vector convention (docs/definitions.md, "Conventions"): ``W_Q, W_K, W_V`` are ``d_model x d_head``,
``W_O`` is ``d_head x d_model``, ``W_E`` is ``vocab x d_model``, ``W_U`` is
``d_model x vocab``. Folding reads through the norms:
``W_{Q,K,V} <- C diag(g) W`` and ``W_U <- C diag(g_f) W_U`` with
``C = I - 11^T / d_model`` for LayerNorm and ``C = I`` for RMSNorm; ``g`` is the stored
weight plus the family's ``norm_weight_offset`` (Gemma: ``1 + w``). Family quirks read here:
a norm on the attention output (sandwich norm) scales each position by one positive factor
shared by all heads, then by ``g_post``, so folding gives ``W_O <- W_O diag(g_post)``; an
attention-output multiplier ``m`` gives ``W_O <- m W_O``. ``W_E`` is what a token adds to the
residual: ``embed_scale * W_E`` (through the embedding norm, row by row, where the family has
one). ``W_U`` carries the positive logit factor; a logit soft cap is not applied (kappa reads
the logits before it; the cap is monotone per token).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .dense import dense_bias, dense_rows, dense_weight, weight_of
from .families import (
    Family,
    Geometry,
    attn_norm_module,
    embed_scale_of,
    family_of,
    final_norm_module,
    geometry_of,
    get_module,
    logit_factor_of,
    modules_at,
    post_attn_norm_module,
    split_qkv,
)
from .latent import LatentRead, read_latent
from .qkv_layouts import split_gate


@dataclass
class LayerWeights:
    """One attention layer, per head. K and V have ``n_kv_heads`` heads."""

    W_Q: torch.Tensor | None  # (n_heads, d_model, d_head); None when read with qk=False (the self-check), or latent
    W_K: torch.Tensor | None  # (n_kv_heads, d_model, d_head); None when read with qk=False, or latent
    W_V: torch.Tensor  # (n_kv_heads, d_model, d_head)
    W_O: torch.Tensor  # (n_heads, d_head, d_model)
    b_Q: torch.Tensor | None  # (n_heads, d_head)
    b_K: torch.Tensor | None  # (n_kv_heads, d_head)
    b_V: torch.Tensor | None  # (n_kv_heads, d_head)
    b_O: torch.Tensor | None  # (d_model,)
    norm_scale: torch.Tensor  # (d_model,) pre-attention norm weight g (ones where there is none)
    post_norm_scale: torch.Tensor | None = None  # (d_model,) sandwich norm weight g_post, folded into W_O
    out_multiplier: float = 1.0  # attention-output multiplier, folded into W_O
    latent: LatentRead | None = None  # multi-head latent attention: W_V = W_DKV diag(g_c) W_UV^h (latent.py)
    W_G: torch.Tensor | None = None  # (n_heads, d_model, d_head): output gate, z_h *= sigmoid(x W_G^h + b_G^h)
    b_G: torch.Tensor | None = None  # (n_heads, d_head)


@dataclass
class ModelWeights:
    """Every head's weights plus the embedding, unembedding and norm scales."""

    family: str
    geometry: Geometry
    layers: list[LayerWeights]
    W_E: torch.Tensor  # (vocab, d_model)
    W_U: torch.Tensor  # (d_model, vocab)
    final_norm_scale: torch.Tensor  # (d_model,)
    folded: bool

    def W_V_of(self, layer: int, head: int) -> torch.Tensor:
        """``W_V`` of query head ``head``: its key/value group's (grouped-query attention)."""
        return self.layers[layer].W_V[self.geometry.kv_group(head)]

    def W_K_of(self, layer: int, head: int) -> torch.Tensor:
        """``W_K`` of query head ``head``: its key/value group's."""
        W_K = self.layers[layer].W_K
        assert W_K is not None, "extract_weights reads W_K of every layer (qk=True) but a latent attention's"
        return W_K[self.geometry.kv_group(head)]

    def W_OV(self, layer: int, head: int) -> torch.Tensor:
        """``W_OV = W_V W_O`` (d_model x d_model)."""
        return self.W_V_of(layer, head) @ self.layers[layer].W_O[head]

    def W_QK(self, layer: int, head: int) -> torch.Tensor:
        """``W_QK = W_Q W_K^T`` (d_model x d_model)."""
        W_Q = self.layers[layer].W_Q
        assert W_Q is not None, "extract_weights reads W_Q of every layer (qk=True) but a latent attention's"
        return W_Q[head] @ self.W_K_of(layer, head).T

    def W_V_per_query_head(self, layer: int) -> torch.Tensor:
        """``W_V`` expanded to one entry per query head: (n_heads, d_model, d_head)."""
        return self.layers[layer].W_V.repeat_interleave(self.geometry.group_size, dim=0)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def layer(self, layer: int) -> LayerWeights:
        """Layer ``layer``'s weights (the `StreamedWeights` interface)."""
        return self.layers[layer]

    def vocab_blocks(self, rows: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(W_U[:, a:b], W_E[a:b])`` over the vocabulary in blocks of ``rows`` (None: one block)."""
        vocab = self.W_E.shape[0]
        step = vocab if rows is None else rows
        for start in range(0, vocab, step):
            yield self.W_U[:, start : start + step], self.W_E[start : start + step]


VOCAB_BLOCK_ELEMENTS = 1 << 22  # a vocabulary block of W_E holds about this many entries (32 MB in float64)


@dataclass
class StreamedWeights:
    """The reads of `ModelWeights`, made from the model when asked and never kept: memory that
    scales with one layer, not the model.

    ``layer(l)``: layer ``l``'s ``W_V``, ``W_O`` (float32, dequantized, folded as
    `extract_weights` folds them; ``W_Q``, ``W_K`` not read); ``vocab_blocks(rows)``:
    ``(W_U[:, a:b], W_E[a:b])`` in blocks of vocabulary rows, so that no full float32 copy of
    the embedding or unembedding is ever made. Each read equals the same slice of
    `extract_weights` (tests/test_weights.py).
    """

    model: torch.nn.Module
    family_table: Family
    geometry: Geometry
    folded: bool

    @classmethod
    def of(cls, model, fold: bool = True) -> StreamedWeights:
        """The streamed weights of ``model`` (a CausalLM), folded by default."""
        return cls(model, family_of(model), geometry_of(model), fold)

    @property
    def family(self) -> str:
        return self.family_table.name

    @property
    def n_layers(self) -> int:
        return self.geometry.n_layers

    @torch.no_grad()
    def layer(self, layer: int) -> LayerWeights:
        """Layer ``layer``'s ``W_V``, ``W_O`` and biases (``W_Q``, ``W_K``: None)."""
        block = modules_at(self.model, self.family_table.layers)[self.geometry.block(layer)]
        return block_weights(block, self.family_table, self.geometry, self.folded, self.model.config, qk=False)

    def default_rows(self) -> int:
        """Vocabulary rows per block: `VOCAB_BLOCK_ELEMENTS` entries of ``W_E``."""
        return max(1, VOCAB_BLOCK_ELEMENTS // self.geometry.d_model)

    @torch.no_grad()
    def vocab_blocks(self, rows: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(W_U[:, a:b], W_E[a:b])`` (float32, CPU) in blocks of ``rows`` vocabulary rows (default `default_rows`)."""
        fam, model = self.family_table, self.model
        vocab = int(weight_of_embedding(model).shape[0])
        step = self.default_rows() if rows is None else rows
        final = final_norm_module(model, fam)
        scale = norm_scale(final, self.geometry.d_model, fam.norm_weight_offset)
        kind = fam.norm_kind if final is not None else "none"
        for start in range(0, vocab, step):
            stop = min(vocab, start + step)
            W_U = _unembedding_columns(model, fam, start, stop)
            yield (folded_read(scale, kind, W_U) if self.folded else W_U), _embedding_rows(model, fam, start, stop)


def norm_scale(module: torch.nn.Module | None, d_model: int, offset: float = 0.0) -> torch.Tensor:
    """A norm's effective scale ``g = offset + w`` (float32, CPU); ones for no norm or no weight."""
    weight = getattr(module, "weight", None) if module is not None else None
    if weight is None:
        return torch.ones(d_model)
    return weight.detach().float().cpu() + offset


def _read_map(scale: torch.Tensor, norm_kind: str) -> torch.Tensor:
    """The linear map a norm applies before a projection: ``C diag(g)`` or ``diag(g)`` (``norm_kind="none"``: I)."""
    d = scale.shape[0]
    read = torch.diag(scale)
    if norm_kind == "layernorm":
        centre = torch.eye(d) - torch.full((d, d), 1.0 / d)
        read = centre @ read
    return read


def folded_read(scale: torch.Tensor, norm_kind: str, W: torch.Tensor) -> torch.Tensor:
    """``_read_map(scale, norm_kind) @ W`` (``W``: ``(..., d_model, k)``). A diagonal map (RMSNorm, or
    no norm) scales the rows, ``g[:, None] W``: the same floats as the matmul (its other terms are exact
    zeros) without its ``2 d_model^2 k`` FLOPs; a LayerNorm's centred map stays the matmul."""
    if norm_kind == "layernorm":
        return _read_map(scale, norm_kind).to(W.device) @ W
    return scale.to(W.device)[:, None] * W


def block_weights(block, fam: Family, geo: Geometry, fold: bool, config, device=None, qk: bool = True) -> LayerWeights:
    """One block's per-head weights; ``qk=False`` skips ``W_Q``/``W_K`` (None), for the self-check."""
    device = torch.device("cpu") if device is None else device
    attn = get_module(block, fam.attn)
    latent = read_latent(attn, fam, geo, device) if fam.latent_norm is not None else None
    W_G = b_G = None
    if latent is not None:  # no W_Q, W_K as one linear map; W_V through the latent (latent.py)
        q = k = b_q = b_k = b_v = None
        v = latent.W_V().transpose(1, 2)
    else:
        projs = [get_module(attn, name) for name in fam.qkv]
        dense = [dense_weight(p).to(device) for p in projs]
        q, k, v = split_qkv(fam.qkv_layout, dense, geo)
        biases = [b for b in (dense_bias(p) for p in projs) if b is not None]
        if len(biases) != len(projs):
            b_q = b_k = b_v = None
        else:
            b_q, b_k, b_v = split_qkv(fam.qkv_layout, [b.to(device) for b in biases], geo)
        if fam.qkv_layout == "separate_gated":  # the gate reads the normed input, as W_Q does
            W_G = split_gate(dense[0], geo).transpose(1, 2).contiguous()
            b_G = None if b_q is None else split_gate(biases[0].to(device), geo)
    out = get_module(attn, fam.out_proj)
    w_o = dense_weight(out).to(device)  # (d_model, n_heads * d_head)
    W_O = w_o.T.reshape(geo.n_heads, geo.d_head, geo.d_model)
    b_o = dense_bias(out)
    pre_norm = attn_norm_module(block, fam)
    scale = norm_scale(pre_norm, geo.d_model, fam.norm_weight_offset)
    post_norm = post_attn_norm_module(block, fam)
    post_scale = None if post_norm is None else norm_scale(post_norm, geo.d_model, fam.norm_weight_offset)
    multiplier = fam.out_multiplier(config)
    in_multiplier = float(getattr(config, fam.attn_in_multiplier, 1.0)) if fam.attn_in_multiplier else 1.0
    # (heads, d_head, d_model) -> (heads, d_model, d_head): row-vector convention
    W_Q = q.transpose(1, 2).contiguous() if qk and q is not None else None
    W_K = k.transpose(1, 2).contiguous() if qk and k is not None else None
    W_V = v.transpose(1, 2).contiguous()
    if fold:
        kind = fam.norm_kind if pre_norm is not None else "none"
        read = scale * in_multiplier  # the attention reads the normed input times it (Falcon-H1)
        W_Q = None if W_Q is None else folded_read(read, kind, W_Q)
        W_K = None if W_K is None else folded_read(read, kind, W_K)
        W_V = folded_read(read, kind, W_V)
        W_G = None if W_G is None else folded_read(read, kind, W_G)
        if post_scale is not None:
            W_O = W_O * post_scale.to(device)
        W_O = W_O * multiplier
    return LayerWeights(
        W_Q=W_Q,
        W_K=W_K,
        W_V=W_V,
        W_O=W_O.contiguous(),
        b_Q=b_q,
        b_K=b_k,
        b_V=b_v,
        b_O=None if b_o is None else b_o.to(device),
        norm_scale=scale,
        post_norm_scale=post_scale,
        out_multiplier=multiplier,
        latent=latent,
        W_G=W_G,
        b_G=b_G,
    )


@torch.no_grad()
def layer_weights(model, layer: int, fold: bool = False, device=None) -> LayerWeights:
    """One layer's per-head weights (float32, dequantized) on ``device`` (default CPU); unfolded by default."""
    fam, geo = family_of(model), geometry_of(model)
    block = modules_at(model, fam.layers)[geo.block(layer)]
    return block_weights(block, fam, geo, fold, model.config, device)


def attention_blocks_of(model, fam: Family, geo: Geometry) -> list[torch.nn.Module]:
    """The decoder blocks of attention layers 0 .. n_layers - 1 (every block, unless the stack is a hybrid)."""
    blocks = modules_at(model, fam.layers)
    return [blocks[geo.block(layer)] for layer in range(geo.n_layers)]


def weight_of_embedding(model) -> torch.Tensor:
    """The stored input embedding (vocab x d_model), as it is."""
    return weight_of(model.get_input_embeddings())


def _embedding_rows(model, fam: Family, start: int, stop: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``start:stop`` of `embedding_matrix` (float32, CPU); ``rows``: these token ids' rows instead."""
    embedding = model.get_input_embeddings()
    if rows is None:
        E = dense_rows(embedding, start, stop)
    else:
        stored = weight_of(embedding)
        floating = stored.dtype.is_floating_point
        E = (stored.detach() if floating else dense_weight(embedding))[rows.to(stored.device)].float()
    W_E = E * embed_scale_of(model, fam)
    if fam.embed_norm is not None:
        norm = get_module(model, fam.embed_norm)
        param = next(norm.parameters(), None)
        if param is not None:
            W_E = norm(W_E.to(device=param.device, dtype=param.dtype)).float()
        else:
            W_E = norm(W_E)
    return W_E.float().cpu()


def _unembedding_columns(model, fam: Family, start: int, stop: int) -> torch.Tensor:
    """Columns ``start:stop`` of the unfolded ``W_U`` (d_model x vocab, float32, CPU), logit factor included."""
    return dense_rows(model.get_output_embeddings(), start, stop).T.contiguous() * logit_factor_of(model.config, fam)


@torch.no_grad()
def embedding_matrix(model, fam: Family | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``W_E`` (vocab x d_model, float32, CPU): what each token adds to the residual stream.

    ``embed_scale * E`` for the stored embedding ``E``; through the family's embedding norm,
    row by row, where it has one (exact: a norm acts on each token alone). ``rows``: only
    these token ids' rows, in that order (the self-check reads a few).
    """
    fam = fam or family_of(model)
    return _embedding_rows(model, fam, 0, int(weight_of_embedding(model).shape[0]), rows)


@torch.no_grad()
def extract_weights(model, fold: bool = True) -> ModelWeights:
    """All heads' ``W_Q, W_K, W_V, W_O`` (float32) plus ``W_E``, ``W_U`` and norm scales.

    With ``fold=True`` (the default for analysis) the pre-attention norm scales fold
    into the read side and the final norm into ``W_U`` (docs/definitions.md, "Reading the weights").
    """
    fam = family_of(model)
    geo = geometry_of(model)
    blocks = attention_blocks_of(model, fam, geo)
    layers = [block_weights(block, fam, geo, fold, model.config) for block in blocks]
    W_E = embedding_matrix(model, fam)  # (vocab, d_model)
    W_U = _unembedding_columns(model, fam, 0, int(weight_of(model.get_output_embeddings()).shape[0]))
    final = final_norm_module(model, fam)
    final_scale = norm_scale(final, geo.d_model, fam.norm_weight_offset)
    if fold:
        W_U = folded_read(final_scale, fam.norm_kind if final is not None else "none", W_U)
    return ModelWeights(
        family=fam.name,
        geometry=geo,
        layers=layers,
        W_E=W_E,
        W_U=W_U,
        final_norm_scale=final_scale,
        folded=fold,
    )
