"""The segment cache: content keys, entries (what a cached segment holds per layer), and the
tiered store with byte budgets, LRU eviction and pinning."""
