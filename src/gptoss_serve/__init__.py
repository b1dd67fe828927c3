"""gptoss-serve: self-host OpenAI's gpt-oss models behind the OpenAI Responses API."""

__version__ = "0.1.0"
