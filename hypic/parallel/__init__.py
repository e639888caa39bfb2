"""Segment-level parallelism: cold segments prefilled on several devices at once (DESIGN §7)."""
