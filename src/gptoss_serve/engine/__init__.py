"""Engines: what turns prompts into token streams. The server sees only ``EngineClient``."""
