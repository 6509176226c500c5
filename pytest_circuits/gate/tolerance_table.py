"""The built-in invariants' tolerances, name -> (default, meaning, may be negative), in gate order.

Generated from the invariant registry by ``python scripts/regenerate_docs.py``: do not edit; declare a
tolerance on its invariant (``Invariant.tolerances``). Light: the plugin reads it at start-up.
"""

# fmt: off
BUILT_IN: dict[str, tuple[float | int | bool, str, bool]] = {
    "kappa": (0.15, "|delta kappa| and |delta kappa_trace| per head", False),
    "rank": (0.8, "minimum Spearman rank correlation of kappa across heads", True),
    "min_ov_gain": (0.01, "heads with OV gain below this x the largest: kappa not compared", False),
    "shift": (1.0, "|mean delta kappa_z| across heads, in null standard deviations", False),
    "ov_gain": (0.1, "|ln(ov_gain' / ov_gain)| of key heads (0.1: about 10%)", False),
    "top_k": (0, "at most this many key heads per routing score and for knockouts (0: every one)", False),
    "min_score": (0.2, "a routing score below this does not make a key head", False),
    "min_delta": (0.1, "a knockout delta below this (nats) does not make a key head", False),
    "copy_loss": (0.25, "|delta copy loss|, nats", False),
    "copy_gain": (0.25, "|delta copy gain|, nats", False),
    "outside_interval": (True, "copy_loss and knockout_deltas fail only when a change is both beyond its tolerance and outside sampling noise: its 95% paired interval over the probe's sequences excludes 0", False),
    "prefix": (0.1, "|delta prefix_matching| / |delta previous_token| of key heads", False),
    "knockout": (0.5, "|delta knockout_delta| / |knockout_delta| of key heads", False),
    "swap_copy_loss": (0.5, "across base models: how far copy loss may rise, nats", False),
    "swap_copy_gain": (0.1, "across base models: how far copy_gain / first_copy_loss may fall", False),
    "swap_induction_score": (0.3, "across base models: prefix_matching that makes an induction head", False),
    "swap_induction_heads": (1, "across base models: induction heads the new model needs (at most the old model's count)", False),
    "swap_prefix": (0.15, "across base models: how far the best prefix_matching may fall", False),
    "swap_depth": (0.35, "across base models: how far the induction heads' mean depth (fraction of the stack) may move", False),
    "swap_share": (0.25, "across base models: how far the shares of copying / suppression heads may move", False),
    "swap_kappa_w1": (5.0, "across base models: 1-Wasserstein distance of the kappa_z distributions, null sds", False),
    "swap_knockout": (0.5, "across base models: how far the largest knockout delta may fall, x its size", False),
    "swap_concentration": (0.3, "across base models: how far the top-3 share of the knockout effect may move", False),
}
# fmt: on
