"""Building a round: the anchor rollout from π_ref (candidates, verification, placement), lazy waves, anchor
bookkeeping and the anchor cache, column anchors, dynamic sampling and its refill rounds, anchors for a
``rollout_func``, and multimodal rows."""
