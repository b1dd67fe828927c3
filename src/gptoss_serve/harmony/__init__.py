"""Harmony: rendering conversations to tokens and parsing tokens back, over openai-harmony."""
