"""The OpenAI Responses API over an injected engine client. Never imports torch."""
