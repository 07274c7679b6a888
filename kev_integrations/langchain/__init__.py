"""LangChain front end: `KevLLM` (text) and `ChatKev` (chat), thin over `kev_engine`.

A `chain.batch(...)` reaches the engine as one packed pass, even when each input has its own
adapter or sampling settings (through `configurable_fields`).
"""

from .chat import ChatKev
from .configurable import KevConfigurableFields
from .llm import KevLLM

__all__ = ["ChatKev", "KevConfigurableFields", "KevLLM"]
