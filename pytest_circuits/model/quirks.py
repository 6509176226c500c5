"""The quirk tags of the family table (`family_table.Family.quirks`): what each does to a model, and how
it bears on the figures (docs/families.md shows them)."""

from __future__ import annotations

QUIRKS = {
    "fused_qkv": "one projection holds Q, K and V; split by the layout named in the table",
    "conv1d": "projections stored (in, out) (GPT-2 Conv1D); read transposed",
    "multi_query": "one K/V head shared by every query head; W_OV = W_V[0] W_O[h]",
    "grouped_query": "K/V heads shared by groups of query heads; W_OV = W_V[h // group] W_O[h]",
    "qkv_bias": "biases on Q/K/V (b_V enters the attention output, not W_OV)",
    "learned_positions": "learned absolute position embeddings added to the residual",
    "rotary": "rotary positions on Q and K: change A only, not W_OV",
    "partial_rotary": "rotary on part of each head's Q/K only: changes A only",
    "alibi": "ALiBi position bias added to the scores: changes A only (the self-check uses the A used)",
    "parallel_block": "attention and MLP read the same normed residual; the attention read is unchanged",
    "qk_norm": "a norm on each head's Q and K: changes A only",
    "qk_norm_full": "a norm across all heads of Q and of K (OLMo 2): changes A only",
    "sandwich_norm": "a norm on the attention output: per position one positive factor for all heads, its weight folds into W_O",
    "post_norm_only": "no pre-attention norm: heads read the raw residual, nothing folds on the read side",
    "norm_offset": "the norm scales by (1 + w), w stored (Gemma's RMSNorm, Nemotron's LayerNorm1P): the fold uses g = 1 + w",
    "embed_scale": "embedding multiplied by a positive scalar (sqrt(d_model) or a multiplier): kappa unchanged, W_E carries it",
    "embed_norm": "a LayerNorm on the embedding: W_E is read through it row by row (exact, per token)",
    "sliding_window": "some or all layers attend within a window; a probe longer than it is refused in one line",
    "local_attention": "alternate layers attend within a local window; a probe longer than it is refused",
    "no_score_scaling": "scores not divided by sqrt(d_head): changes A only",
    "attn_softcap": "attention logits soft-capped: changes A only",
    "logit_softcap": "final logits soft-capped (monotone per token); kappa reads the logits before the cap",
    "logit_scale": "logits multiplied or divided by a positive scalar: kappa unchanged, W_U carries it",
    "multipliers": (
        "embedding, attention, residual (MiniCPM's scale_depth / sqrt(n_blocks)) and logit multipliers "
        "(positive scalars): kappa unchanged, the fold carries them"
    ),
    "attention_sinks": "a learned per-head sink logit joins each softmax: rows of A sum to < 1; W_OV unchanged",
    "moe": "mixture-of-experts MLP: not part of the OV read; routing is replayed per call in knockouts",
    "nope_layers": "some layers use no positional encoding: changes A only",
    "lm_head_bias": "the unembedding has a bias: a constant per token, outside W_U",
    "nonparametric_norm": "LayerNorm without weight or bias: g = 1",
    "no_norm_bias": "LayerNorm without bias (centres, scales by w)",
    "attn_output_residual": "the attention module adds the residual to its own output (BLOOM); the self-check subtracts it",
    "hybrid": (
        "attention in some blocks only (config.layer_types): their heads are L0, L1, ... in block order "
        "(geometry.attention_layers gives each one's block); Mamba, gated DeltaNet, Kimi delta attention, RG-LRU or "
        "convolution blocks are the rest of the stack, as MLPs are"
    ),
    "mamba_beside": (
        "a Mamba-2 mixer beside the attention in every block, reading the same normed input; its output joins "
        "the residual write (the rest of the stack, as an MLP is); the attention reads the normed input times a "
        "multiplier, folded into W_V"
    ),
    "output_gate": (
        "each head's output times sigmoid(x W_G^h) per channel and query (Qwen3-Next): kappa and ov_gain read the "
        "ungated W_V^h W_O^h (equal gates); the self-check, routing scores, copy loss and knockouts see the gate"
    ),
    "sparse_indexer": (
        "a lightning indexer keeps each query's top-k keys (DeepSeek-V3.2's sparse attention), masking the rest: "
        "changes A only (the self-check, routing scores and knockouts use the pattern the module computes)"
    ),
    "latent_attention": (
        "multi-head latent attention: c = norm(x W_DKV), v_h = c W_UV^h, so W_OV = W_DKV diag(g_c) W_UV^h W_O^h "
        "(the latent norm's weight g_c folded, its per-position divisor a positive factor like the pre-attention "
        "norm's); keys c W_UK^h plus a RoPE part shared by the heads, queries through their own low-rank norm: "
        "change A only; no W_Q, W_K as one linear map"
    ),
}
