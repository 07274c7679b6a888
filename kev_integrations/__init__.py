"""LangChain and LlamaIndex front ends over `kev_engine` (built in later issues)."""

__all__: list[str] = []
