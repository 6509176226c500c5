"""The built-in invariants' tolerances, name -> (default, meaning, least value or None), in gate order.

Generated from the invariant registry by ``python scripts/regenerate_docs.py``: do not edit; declare a
tolerance on its invariant (``Invariant.tolerances``). Light: the plugin reads it at start-up.
"""

# fmt: off
BUILT_IN: dict[str, tuple[float | int | bool, str, float | int | None]] = {
    "kappa": (0.15, "|delta kappa| and |delta kappa_trace| per head", 0),
    "rank": (0.8, "minimum Spearman rank correlation of kappa across heads", -1),
    "min_ov_gain": (0.01, "heads with OV gain below this x the largest: kappa not compared", 0),
    "shift": (1.0, "|mean delta kappa_z| across heads, in null standard deviations", 0),
    "ov_gain": (0.1, "|ln(ov_gain' / ov_gain)| of key heads (0.1: about 10%)", 0),
    "top_k": (0, "at most this many key heads per routing score and for knockouts (0: every one)", 0),
    "min_score": (0.2, "a routing score below this does not make a key head", 0),
    "min_delta": (0.1, "a knockout delta below this (nats) does not make a key head", 0),
    "copy_loss": (0.25, "|delta copy loss|, nats", 0),
    "copy_gain": (0.25, "|delta copy gain|, nats", 0),
    "outside_interval": (True, "copy_loss and knockout_deltas weigh sampling noise: by the sequential rule (looks), or, against a baseline without looks, a change fails only when beyond its tolerance and its 95% paired interval over the probe's sequences excludes 0 (the fixed rule); off: the plain tolerance", 0),
    "looks": (4, "the most looks of the sequential rule (gate/sequential.py), each n fresh probe sequences, drawn while a change is undecided; a pass needs the change shown within its tolerance; 1: the fixed rule", 1),
    "prefix": (0.1, "|delta prefix_matching| / |delta previous_token| of key heads", 0),
    "knockout": (0.5, "|delta knockout_delta| / |knockout_delta| of key heads", 0),
    "change_screen": (0.0, "knock out exactly only key heads whose change plain AtP estimates at this fraction of their tolerance or more (0: every key head exactly)", 0),
    "reliance": (0.5, "how far the mean cited-chunk drop of an audit slice may shrink, x the baseline's", 0),
    "min_reliance": (1.0, "a case whose baseline drop is below this (nats) is reported, not gated", 0),
    "attribution": (0.8, "least share of relied audit cases whose top chunk is the baseline's", 0),
    "answer_logprob": (0.25, "|delta answer log-probability per token| of an audit slice, mean over cases, nats", 0),
    "swap_copy_loss": (0.5, "across base models: how far copy loss may rise, nats", 0),
    "swap_copy_gain": (0.1, "across base models: how far copy_gain / first_copy_loss may fall", 0),
    "swap_induction_score": (0.3, "across base models: prefix_matching that makes an induction head", 0),
    "swap_induction_heads": (1, "across base models: induction heads the new model needs (at most the old model's count)", 0),
    "swap_prefix": (0.15, "across base models: how far the best prefix_matching may fall", 0),
    "swap_depth": (0.35, "across base models: how far the induction heads' mean depth (fraction of the stack) may move", 0),
    "swap_share": (0.25, "across base models: how far the shares of copying / suppression heads may move", 0),
    "swap_kappa_w1": (5.0, "across base models: 1-Wasserstein distance of the kappa_z distributions, null sds", 0),
    "swap_knockout": (0.5, "across base models: how far the largest knockout delta may fall, x its size", 0),
    "swap_concentration": (0.3, "across base models: how far the top-3 share of the knockout effect may move", 0),
}
# fmt: on
