"""The HYPIC engine: plan a segmented request against the cache, prefill cold segments
standalone, run the combine pass over the recompute set, decode."""
