"""Whether two sides' cache layouts pair up (:class:`~helixserve.protocol.disagg.KVLayout`), and
what a gen rank asks a ctx rank with: the fields that must be equal, the ctx world's mapping each
side must be able to hold, and the drafter's prompt cache (``draft``), which travels only when
both sides name the same drafter."""

from __future__ import annotations

from helixserve.protocol.disagg import SIDE_FIELDS, KVLayout


class LayoutMismatchError(ValueError):
    """The two sides of a transfer disagree on the cache layout (names every differing field)."""


def check_layout(ours: KVLayout, theirs: KVLayout, ours_name: str, theirs_name: str, *,
                 mapping: bool = False) -> None:
    """Raise LayoutMismatchError naming each differing field with both values (`ours_name`'s first).

    What the caches hold must be equal. The ctx world's mapping (``ctx_tp_size``, ``ctx_rank``)
    must be one each side can hold (KDA heads divisible by ``ctx_tp_size``, ``ctx_rank`` below it)
    and, with `mapping`, the same on both sides: a ctx rank checking the layout a gen rank asks
    it with, a gen rank checking a sender's against the ticket's. A drafter's prompt cache
    (``draft``) is checked only with `mapping` and only when `theirs` asks for one: it must be
    the one `ours` holds.
    """
    check_mapping(ours, ours_name)
    if theirs is ours or theirs == ours:  # (every request: the field walk only on a difference)
        return
    check_mapping(theirs, theirs_name)
    diffs = ours.mismatches(theirs, ignore=frozenset({"draft"}) if mapping else SIDE_FIELDS)
    if mapping and theirs.draft is not None and theirs.draft != ours.draft:  # asked for a drafter cache not held
        diffs.append(f"draft: {ours.draft!r} != {theirs.draft!r}")
    if diffs:
        raise LayoutMismatchError(
            f"KV layout mismatch ({ours_name} != {theirs_name}): " + "; ".join(diffs))


def check_mapping(layout: KVLayout, name: str, cp_rank: int = 0, cp_size: int = 1) -> None:
    """LayoutMismatchError unless `layout`'s ctx world, and a gen rank ``cp_rank`` of ``cp_size``,
    can split its KDA heads (a layout built without validation, or a gen CP group, may not)."""
    heads = layout.num_kda_heads
    for field, rank_field, rank, size in (("ctx_tp_size", "ctx_rank", layout.ctx_rank, layout.ctx_tp_size),
                                          ("cp_size", "cp_rank", cp_rank, cp_size)):
        if size < 1 or heads % size:
            raise LayoutMismatchError(f"{name}: num_kda_heads {heads} cannot be split over {field}={size}")
        if not 0 <= rank < size:
            raise LayoutMismatchError(f"{name}: {rank_field} {rank} outside {field}={size}")


def source_layout(own: KVLayout, advertised: KVLayout) -> KVLayout:
    """A gen rank's layout with the ctx mapping (``ctx_tp_size``, ``ctx_rank``) of `advertised`: what
    it asks that ctx rank with. `own` itself when the mapping is its own or one no ctx world can
    have (`check_layout` refuses that ticket, naming the field)."""
    if (own.ctx_tp_size, own.ctx_rank) == (advertised.ctx_tp_size, advertised.ctx_rank):
        return own
    try:
        check_mapping(advertised, "ctx")
    except LayoutMismatchError:
        return own
    return own.model_copy(update={"ctx_tp_size": advertised.ctx_tp_size, "ctx_rank": advertised.ctx_rank})


def asked_layout(own: KVLayout, advertised: KVLayout, takes_draft: bool) -> KVLayout:
    """What a gen rank asks a ctx rank with: `source_layout`, naming the drafter's prompt cache
    (``draft``) when this rank takes it (`takes_draft`: the CP group's leader, whose drafter is the
    one the ctx advertised), else none."""
    layout = source_layout(own, advertised)
    draft = own.draft if takes_draft else None
    return layout if layout.draft == draft else layout.model_copy(update={"draft": draft})
